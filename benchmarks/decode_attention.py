"""A decode step's attention alone on IREE: the rules with and without `attention_one_query_as_grouped_sums` (issue 34).

    python benchmarks/decode_attention.py                        # moe_sort's small model: 8 heads over 4, 2049 keys
    python benchmarks/decode_attention.py --shape qwen3-30b-a3b  # 32 heads over 4, of 128, 1041 keys

One query row over T cached keys (grouped-query: `--heads` query heads over `--kv-heads` key-value heads), a bool mask
letting every key through, exported with a Dim on T as compile_lm's decode reads its cache (`seen` = start + 1):
- `rules`: `scaled_dot_product_attention(..., enable_gqa=True)` through the IREE backend's default rules
  (`attention_one_query_as_grouped_sums`: per key-value head, `(q * k).sum(-1)` and `(p * v).sum(-2)` over the keys
  and values in place);
- `without_rule`: the same without that rule (the keys and values repeated per query head, the cache packed for
  data-tiled products: the form before it);
- `grouped_sum`: the same form written by hand in the module (softmax between), the rules applied;
- `eager`: torch's SDPA on the same inputs.
IREE local-sync, one thread, CPU time (time.process_time) per call, median of `--calls` after 3 warm-up calls; each
IREE route's largest difference from eager over two key lengths is printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

SHAPES = {"small": (8, 4, 64, 2049), "qwen3-30b-a3b": (32, 4, 128, 1041)}


class Sdpa(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class GroupedSum(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, heads, _, size = q.shape
        kv = k.shape[1]
        rows = q.reshape(b, kv, heads // kv, 1, size) * size**-0.5
        scores = (rows * k.unsqueeze(2)).sum(-1)  # [b, kv, group, T]
        scores = scores.masked_fill(~mask.reshape(b, 1, 1, -1), float("-inf"))
        weights = torch.softmax(scores, -1)
        return (weights.unsqueeze(-1) * v.unsqueeze(2)).sum(-2).reshape(b, heads, 1, size)


def _inputs(heads: int, kv: int, size: int, keys: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn(1, heads, 1, size, generator=g)
    k, v = (torch.randn(1, kv, keys, size, generator=g) for _ in range(2))
    return q, k, v, torch.ones(1, 1, 1, keys, dtype=torch.bool)


def _median_ms(call: Any, inputs: tuple[torch.Tensor, ...], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.process_time()
        call(*inputs)
        times.append(time.process_time() - start)
    return round(1e3 * statistics.median(times), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    import fx_rewrites
    from fx_rewrites import testing
    from fx_rewrites.backends.iree import IreeBackend

    torch.set_num_threads(1)
    heads, kv, size, keys = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    inputs, shorter = _inputs(heads, kv, size, keys, g), _inputs(heads, kv, size, keys - 300, g)
    dim = torch.export.Dim("keys", min=2, max=4096)
    backend = IreeBackend(driver="local-sync")
    row: dict[str, Any] = {"shape": args.shape, "heads": heads, "kv_heads": kv, "head_size": size, "keys": keys}
    without = IreeBackend(driver="local-sync", rules=backend.rules.without("attention_one_query_as_grouped_sums"))
    for name, module, route in (
        ("rules", Sdpa(), backend),
        ("without_rule", Sdpa(), without),
        ("grouped_sum", GroupedSum(), backend),
    ):
        program = testing.export(module, *inputs, dynamic_shapes=({}, {2: dim}, {2: dim}, {3: dim}))
        compiled = route.compile(fx_rewrites.apply(program, route.rules).program, inputs)
        error = max(float((compiled(*x) - Sdpa()(*x)).abs().max()) for x in (inputs, shorter))
        for _ in range(3):
            compiled(*inputs)
        row[f"{name}_ms"], row[f"{name}_max_abs_diff"] = _median_ms(compiled, inputs, args.calls), error
    row["eager_ms"] = _median_ms(Sdpa(), inputs, args.calls)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
