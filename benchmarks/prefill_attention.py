"""A causal prefill's attention over a static cache alone on IREE, in the forms the rules can write (issue 34).

    python benchmarks/prefill_attention.py                        # moe_sort's small model: 8 heads over 4, of 64
    python benchmarks/prefill_attention.py --shape qwen3-30b-a3b  # 32 heads over 4, of 128
    python benchmarks/prefill_attention.py --routes rules sums eager_causal --rows 2048
    python benchmarks/prefill_attention.py --rows-multiple 8 --routes rules:ASSUME_SHAPES=1 rules eager_causal
    python benchmarks/prefill_attention.py --isa avx2 --routes flash blocks eager_mask eager_causal
    python benchmarks/prefill_attention.py --shape vit --isa avx2 --routes flash blocks eager  # an encoder's

transformers' eager prefill over compile_lm's static cache: `repeat_kv` of the 4 key-value heads, a bool causal
mask over the cache's positions (row i lets keys 0..i through), `scaled_dot_product_attention`, exported with a Dim
on the query rows (the prompt) and compiled by the IREE backend's rules (local-sync):
- `rules`: the ISA's default rules (where on, `attention_as_flash_dispatch[_avx512]`: the hand-written flash
  dispatch; elsewhere `attention_by_key_blocks` where it applies);
- `flash`: the default rules with the ISA's flash dispatch rules first, on or not;
- `blocks`: the default rules without the flash dispatch rules (`attention_by_key_blocks`);
- `whole`: without either (written out over every key);
- `rules:NAME=VALUE,...`: the default rules with `attention_blocks`' constants set so while rewriting (e.g.
  `rules:ALIGN=1,MAX_BLOCKS=4`: the blocks as they were before they were aligned), or `assumptions`'s
  (`rules:ASSUME_SHAPES=1`: the Dims passed to IREE as assumptions; off by default);
- `ROUTE+peel`: that route compiled with `--iree-llvmcpu-vector-pproc-strategy=peel` added (the vector loops over a
  dynamic size peeled instead of masked: on for AVX2's dynamic modules, `IreeTarget.dynamic_flags`; on AVX-512 not);
- `eager_mask`: torch's SDPA with the mask over the cache; `eager_causal`: torch's `is_causal` flash attention
  over the prompt's keys only (what transformers' eager prefill with a DynamicCache calls).
The encoder shapes (`--shape vit`, `whisper_encoder`: benchmarks/runtime.py's models' attention, static rows, no
mask) export `Encoder` (SDPA of q, k, v) without a Dim; their eager route is `eager` (torch's SDPA, flash on CPU).
`--isa avx2` on an AVX-512 host: IREE for znver3 and torch held to AVX2 in a child (benchmarks/cpu_isa.py).
One thread, CPU time (time.process_time) per call, median of `--calls` after 2 warm-up calls, routes interleaved
call by call; each IREE route's largest difference from eager at two prompt lengths is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attrs
import cpu_isa
import torch

PEEL = "--iree-llvmcpu-vector-pproc-strategy=peel"
#: query heads, key-value heads, head size, cache length
SHAPES = {
    "small": (8, 4, 64, 2081),
    "qwen3-30b-a3b": (32, 4, 128, 1041),
    "llama-0.1b": (12, 4, 64, 192),  # benchmarks/generate.py's 0.1B Llama, its cache (prompt 128 + 64 new)
}
#: benchmarks/runtime.py's encoders: batch, heads, head size, tokens (static rows, no mask)
ENCODERS = {"vit": (4, 4, 64, 197), "whisper_encoder": (4, 4, 64, 500)}
FLASH = {
    "avx512": ("attention_as_flash_dispatch_avx512", "unmasked_attention_as_flash_dispatch_avx512"),
    "avx2": ("attention_as_flash_dispatch", "unmasked_attention_as_flash_dispatch"),
}


class Encoder(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


class Sdpa(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        b, kv, keys, size = k.shape
        k = k[:, :, None].expand(b, kv, group, keys, size).reshape(b, kv * group, keys, size)
        v = v[:, :, None].expand(b, kv, group, keys, size).reshape(b, kv * group, keys, size)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def causal_mask(rows: int, keys: int) -> torch.Tensor:
    return (torch.arange(keys)[None, :] <= torch.arange(rows)[:, None])[None, None]


def _inputs(heads: int, kv: int, size: int, keys: int, rows: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn(1, heads, rows, size, generator=g)
    k, v = (torch.randn(1, kv, keys, size, generator=g) for _ in range(2))
    return q, k, v, causal_mask(rows, keys)


def eager_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows = q.shape[-2]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k[..., :rows, :], v[..., :rows, :], is_causal=True, enable_gqa=True
    )


@contextlib.contextmanager
def _constants(settings: str) -> Iterator[None]:
    """`NAME=VALUE,...` set while the route is rewritten and compiled: on backends/iree/rules/attention_blocks.py,
    or on backends/iree/assumptions.py (`ASSUME_SHAPES=1`: the size assumptions passed to IREE)."""
    from fx_rewrites.backends.iree import assumptions
    from fx_rewrites.backends.iree.rules import attention_blocks

    pairs = [item.split("=") for item in settings.split(",") if item]
    owners = {name: attention_blocks if hasattr(attention_blocks, name) else assumptions for name, _ in pairs}
    old = {name: getattr(owners[name], name) for name, _ in pairs}
    try:
        for name, value in pairs:
            setattr(owners[name], name, type(old[name])(int(value)))
        yield
    finally:
        for name, value in old.items():
            setattr(owners[name], name, value)


def _with_flash(backend: Any, isa: str) -> Any:
    """`backend` with the ISA's flash dispatch rules first in its performance rules, on or not."""
    from fx_rewrites.backends.iree.rules import performance
    from fx_rewrites.ruleset import Phases, RuleSet

    perf = performance.for_target(backend.target.name, backend.target.isa)
    names = FLASH[isa]
    chosen = RuleSet([*(performance.ALL[n] for n in names), *perf.without(*(n for n in names if n in perf))])
    sets = [chosen if s is perf else s for s in backend.rules.sets]
    return attrs.evolve(backend, rules=Phases(*sets, name=backend.rules.name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES) + sorted(ENCODERS), default="small")
    parser.add_argument("--rows", type=int, default=2048, help="prompt length (query rows)")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--routes", nargs="+", default=["rules", "whole", "eager_mask", "eager_causal"])
    parser.add_argument("--without", nargs="*", default=[], help="rules left out of every IREE route")
    parser.add_argument(
        "--rows-multiple", type=int, default=1, help="export the rows as this * Dim (the second length rounded to one)"
    )
    cpu_isa.add_argument(parser)
    args = parser.parse_args(argv)
    if (rc := cpu_isa.run_in_child(args.isa, __file__, argv)) is not None:
        return rc
    import fx_rewrites
    from fx_rewrites import testing

    torch.set_num_threads(1)
    isa = cpu_isa.resolve(args.isa)
    g = torch.Generator().manual_seed(0)
    m = args.rows_multiple
    default = cpu_isa.backend(args.isa, driver="local-sync")
    row: dict[str, Any] = {"shape": args.shape, "isa": isa}
    if args.shape in ENCODERS:
        b, heads, size, tokens = ENCODERS[args.shape]
        inputs, shorter = (tuple(torch.randn(b, heads, tokens, size, generator=g) for _ in "qkv") for _ in "ab")
        module, reference, shapes = Encoder(), Encoder(), None
        row |= {"batch": b, "heads": heads, "head_size": size, "tokens": tokens}
    else:
        heads, kv, size, keys = SHAPES[args.shape]
        inputs = _inputs(heads, kv, size, keys, args.rows, g)
        shorter = _inputs(heads, kv, size, keys, (args.rows // 2 + 7) // m * m, g)
        rows = (
            torch.export.Dim("rows", min=2, max=keys) if m == 1 else m * torch.export.Dim("rows", min=1, max=keys // m)
        )
        module, reference, shapes = Sdpa(), eager_causal, ({2: rows}, {}, {}, {2: rows})
        row |= {"heads": heads, "kv_heads": kv, "head_size": size, "keys": keys, "rows": args.rows, "rows_multiple": m}
    calls: dict[str, Any] = {}
    for name in args.routes:
        if name == "eager":
            calls[name] = Encoder()
            continue
        if name == "eager_mask":
            calls[name] = Sdpa()
            continue
        if name == "eager_causal":
            calls[name] = eager_causal
            continue
        base, peel = name.removesuffix("+peel"), name.endswith("+peel")
        left_out = [*args.without, *(["attention_by_key_blocks"] if base == "whole" else [])]
        if base.partition(":")[0] in ("blocks", "whole"):  # the forms before the flash dispatch
            left_out += [n for n in FLASH[isa] if n in default.rules]
        route = attrs.evolve(default, rules=default.rules.without(*left_out)) if left_out else default
        if base.partition(":")[0] == "flash":
            route = _with_flash(route, isa)
        if peel:
            route = attrs.evolve(route, perf_flags=(*route.perf_flags, PEEL))
        program = testing.export(module, *inputs, dynamic_shapes=shapes)
        start = time.monotonic()
        with _constants(base.partition(":")[2]):
            rewritten = fx_rewrites.apply(program, route.rules).program
            calls[name] = route.compile(rewritten, inputs)
        row[f"{name}_compile_s"] = round(time.monotonic() - start, 1)
        row[f"{name}_max_abs_diff"] = max(
            float((calls[name](*x) - reference(*x)).abs().max()) for x in (inputs, shorter)
        )
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(2 + args.calls):
        for name, call in calls.items():
            start = time.process_time()
            call(*inputs)
            if round_ >= 2:
                times[name].append(time.process_time() - start)
    for name, t in times.items():
        row[f"{name}_ms"] = round(1e3 * statistics.median(t), 1)
    print(cpu_isa.header(args.isa), flush=True)
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
