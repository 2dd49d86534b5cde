"""MoE prefill through compile_lm at real prompt lengths: what the experts' sort as ranks costs (issue: moesort).

    python benchmarks/moe_sort.py                                    # 16 and 64 experts, top 2 and 8, 128/512/2048
    python benchmarks/moe_sort.py --experts 64 --top 8 --prompts 128 512 --routes ranks counting --interleave
    python benchmarks/moe_sort.py --micro                            # the sort alone, ranks vs counting sort

Model: `Qwen3MoeForCausalLM` from a config (hidden 512, 4 layers, 8 heads / 4 KV heads, every layer sparse,
moe_intermediate 256, vocab 4096), seeded random weights (randn x 0.05), transformers' default experts path
(`grouped_mm`: each layer sorts its tokens x top_k expert ids; `--impl batched_mm`: no sort). Routes, one child
process per (config, route), or all of a config's in one child, interleaved (`--interleave`):
- `counting` / `ranks`: `fx_rewrites.compile_lm(model, max_cache_len=max prompt + 1)` on IREE local-sync (the
  prefill one function with a Dim on the sequence), the experts' sorts as counting sorts (the rules as they are)
  or as ranks (`counting_sort_for_iree` left out); the time of `generate(ids, max_new_tokens=1)`;
- `eager`: transformers' `model.generate(ids, max_new_tokens=1, do_sample=False)` (DynamicCache).
One thread each (torch.set_num_threads(1), IREE local-sync), CPU time (time.process_time), prompts interleaved
round after round, medians; round 0 warms up. Peak RSS: the process's high-water mark reset
(/proc/self/clear_refs) before a prompt's warm-up call and read after it (the compile's peak is not counted).
IREE prompts whose gathered expert weights (backends/iree/rules/moe.py: rows x in x out floats) pass
`--max-gather-gb` are skipped (prompt 2048 at top 8: 17 GB for gate_up alone; it was killed for memory).
`--micro`: two layers' expert-id sorts alone (topk of [T, E] router probabilities, then the sort of the flattened
ids), rewritten by the IREE rules and compiled with a Dim on T: the sort's own cost per prompt, ranks vs counting.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _hwm_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build(experts: int, top: int, max_len: int, impl: str = "grouped_mm") -> Any:
    sys.path.insert(0, str(ROOT))
    from benchmarks.generate import seeded_for_greedy
    from benchmarks.runtime_models import _tf

    tf = _tf()
    config = tf.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1024, moe_intermediate_size=256, num_experts=experts,
        num_experts_per_tok=top, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=max(max_len, 256), tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    config._experts_implementation = impl
    torch.manual_seed(0)
    return seeded_for_greedy(tf.Qwen3MoeForCausalLM(config).eval())


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(1, 4096, (1, length), generator=torch.Generator().manual_seed(length))


def iree_backend(sort: str) -> Any:
    """IREE local-sync with the experts' sort as a counting sort (`counting`, the default rules) or as ranks
    (`ranks`: the counting sort left out, as before it existed)."""
    from fx_rewrites.backends.iree import IreeBackend

    backend = IreeBackend(driver="local-sync")
    if sort == "ranks":
        backend = IreeBackend(driver="local-sync", rules=backend.rules.without("counting_sort_for_iree"))
    return backend


def _runner(route: str, model: Any, max_len: int) -> Any:
    """(ids) -> the first new token, by `route`: eager generate, or compile_lm with the sort as `route`."""
    if route == "eager":

        def run(ids: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, disable_compile=True
                )
            return out[:, -1]

        return run
    import fx_rewrites

    start = time.perf_counter()
    lm = fx_rewrites.compile_lm(model, max_cache_len=max_len, backend=iree_backend(route))
    fired = {k: v for k, v in lm.reports["prefill"].rewrites.items() if "sort" in k}
    print(json.dumps({"route": route, "compile_s": round(time.perf_counter() - start, 1), "fired": fired}), flush=True)
    return lambda ids: lm.generate(ids, max_new_tokens=1)[:, -1]


def child(args: argparse.Namespace) -> None:
    """Every route of `args.routes` on one model, interleaved: round after round, prompt after prompt."""
    torch.set_num_threads(1)
    max_len = max(args.prompts) + 1
    model = build(args.experts[0], args.top[0], max_len, args.impl)
    runs = {route: _runner(route, model, max_len) for route in args.routes}
    config = model.config
    # the grouped matmul as IREE runs it gathers a weight per row (backends/iree/rules/moe.py): rows x in x out
    gather_gb = {
        p: p * args.top[0] * 2 * config.moe_intermediate_size * config.hidden_size * 4 / 1e9 for p in args.prompts
    }
    cases = [(route, p) for p in args.prompts for route in args.routes]
    for route, p in cases:
        if route != "eager" and gather_gb[p] > args.max_gather_gb:
            print(
                json.dumps({"route": route, "prompt": p, "skipped": f"gathered gate_up weights {gather_gb[p]:.1f} GB"})
            )
    cases = [(route, p) for route, p in cases if route == "eager" or gather_gb[p] <= args.max_gather_gb]
    times: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    peaks: dict[tuple[str, int], float] = {}
    tokens: dict[tuple[str, int], int] = {}
    for r in range(args.rounds + 1):  # round 0 warms up (and measures the peak)
        for route, p in cases:
            ids = _prompt(p)
            if r == 0:
                _hwm_reset()
            start = time.process_time()
            token = runs[route](ids)
            elapsed = time.process_time() - start
            if r == 0:
                peaks[route, p] = _hwm_mb()
                tokens[route, p] = int(token[0])
            else:
                times[route, p].append(elapsed)
    for route, p in cases:
        row = {"route": route, "prompt": p, "ms": round(1e3 * statistics.median(times[route, p]), 1)}
        print(json.dumps({**row, "peak_mb": round(peaks[route, p]), "token": tokens[route, p]}), flush=True)


class _Sorts(torch.nn.Module):
    """Two layers' routing: the top k of E router probabilities per token, the flattened ids sorted."""

    def __init__(self, top: int) -> None:
        super().__init__()
        self.top = top

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        for logits in (x, y):
            ids = torch.topk(torch.softmax(logits, -1), self.top, dim=-1).indices.reshape(-1)
            out.extend(torch.sort(ids))
        return tuple(out)


def micro(args: argparse.Namespace) -> None:
    import fx_rewrites
    from fx_rewrites import testing as rt

    torch.set_num_threads(1)
    for experts, top, sort in itertools.product(args.experts, args.top, ("ranks", "counting")):
        backend = iree_backend(sort)
        g = torch.Generator().manual_seed(0)
        inputs = {p: (torch.randn(p, experts, generator=g), torch.randn(p, experts, generator=g)) for p in args.prompts}
        tokens = torch.export.Dim("tokens", min=2, max=max(args.prompts))
        ep = rt.export(_Sorts(top), *inputs[args.prompts[0]], dynamic_shapes=({0: tokens}, {0: tokens}))
        result = fx_rewrites.apply(ep, backend.rules)
        compiled = backend.compile(result.program, inputs[args.prompts[0]])
        fired = {k: v for k, v in result.report.rewrites.items() if "sort" in k or "topk" in k}
        for p in args.prompts:
            expected = _Sorts(top)(*inputs[p])
            got = compiled(*inputs[p])
            equal = all(torch.equal(a, b) for a, b in zip(got[::2], expected[::2], strict=True))
            _hwm_reset()
            compiled(*inputs[p])
            peak = _hwm_mb()
            times = []
            for _ in range(args.rounds):
                start = time.process_time()
                compiled(*inputs[p])
                times.append(time.process_time() - start)
            row = {"experts": experts, "top": top, "sort": sort, "prompt": p, "n": p * top, "fired": fired}
            print(json.dumps({**row, "ms": round(1e3 * statistics.median(times), 2), "peak_mb": round(peak),
                              "values_equal": equal}), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--top", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--routes", nargs="+", choices=["counting", "ranks", "eager"], default=["counting", "eager"])
    parser.add_argument("--impl", default="grouped_mm", help="config._experts_implementation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--interleave", action="store_true", help="all routes in one child, interleaved")
    parser.add_argument(
        "--max-gather-gb", type=float, default=8.0, help="IREE: skip prompts whose gathered weights pass this"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.micro:
        return micro(args)
    print(f"# {platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.2f}")
    for experts in args.experts:
        for top in args.top:
            for routes in [args.routes] if args.interleave else [[route] for route in args.routes]:
                command = [sys.executable, __file__, "--child", "--experts", str(experts), "--top", str(top),
                           "--routes", *routes, "--impl", args.impl, "--rounds", str(args.rounds),
                           "--max-gather-gb", str(args.max_gather_gb),
                           "--prompts", *map(str, args.prompts)]  # fmt: skip
                out = subprocess.run(command, capture_output=True, text=True, check=False)
                if out.returncode:
                    print(f"# {experts} experts top {top} {routes}: exit {out.returncode}\n{out.stderr[-3000:]}")
                for line in out.stdout.splitlines():
                    print(json.dumps({"experts": experts, "top": top, **json.loads(line)}), flush=True)
    print(f"# load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
