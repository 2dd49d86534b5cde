"""A decode step's attention alone on IREE: the rules with and without `attention_one_query_as_grouped_sums` (issue 34).

    python benchmarks/decode_attention.py                        # moe_sort's small model: 8 heads over 4, 2049 keys
    python benchmarks/decode_attention.py --shape qwen3-30b-a3b  # 32 heads over 4, of 128, 1041 keys
    python benchmarks/decode_attention.py --shape llama-0.1b     # generate.py's 0.1B Llama: 12 over 4, of 64, 193 keys

One query row over T cached keys (grouped-query: query heads over key-value heads), a bool mask letting every key
through, exported with a Dim on T as compile_lm's decode reads its cache (`seen` = start + 1):
- `rules`: `scaled_dot_product_attention(..., enable_gqa=True)` through the IREE backend's default rules
  (`attention_one_query_as_grouped_sums`: per key-value head, `(q * k).sum(-1)` and `(p * v).sum(-2)` over the keys
  and values in place);
- `repeat_kv`: the form transformers' decode has under torch.export (its `repeat_kv` of the keys and values per query
  head, SDPA without gqa: what compile_lm's decode holds), through the default rules (which read the cache's own heads);
- `repeat_kv_copied`: the same with the repeat made a copy (`.clone()`): the rule then attends per query head
  over the copy, as it did on transformers' form before it read through `repeat_kv` (IREE copies the expand either way);
- `without_rule`: the same without that rule (the keys and values repeated per query head, the cache packed for
  data-tiled products: the form before it);
- `grouped_sum`: the same form written by hand in the module (softmax between), the rules applied;
- `eager`: torch's SDPA on the same inputs (`enable_gqa`); `eager_packed`: as transformers' eager decode calls it (its
  `pack_gqa`: the query heads of a group as rows of one SDPA per key-value head).
IREE local-sync, one thread, CPU time (time.process_time) per call, the routes interleaved call after call, median of
`--calls` after 3 warm-up calls; each IREE route's largest difference from eager over two key lengths is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

ROUTES = ("rules", "repeat_kv", "repeat_kv_copied", "without_rule", "grouped_sum")
SHAPES = {"small": (8, 4, 64, 2049), "qwen3-30b-a3b": (32, 4, 128, 1041), "llama-0.1b": (12, 4, 64, 193)}


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


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' `repeat_kv` (integrations/sdpa_attention.py)."""
    b, kv, keys, size = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, keys, size).reshape(b, kv * n, keys, size)


class RepeatKv(torch.nn.Module):
    def __init__(self, copied: bool = False) -> None:
        super().__init__()
        self.copied = copied

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n), repeat_kv(v, n)
        if self.copied:
            k, v = k.clone(), v.clone()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class EagerPacked(torch.nn.Module):
    """transformers' eager decode: `pack_gqa` (the query [b, heads, 1, e] as [b, kv heads, group, e])."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, heads, _, size = q.shape
        rows = q.reshape(b, k.shape[1], heads // k.shape[1], size)
        out = torch.nn.functional.scaled_dot_product_attention(rows, k, v, attn_mask=mask)
        return out.reshape(b, heads, 1, size)


def _inputs(heads: int, kv: int, size: int, keys: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn(1, heads, 1, size, generator=g)
    k, v = (torch.randn(1, kv, keys, size, generator=g) for _ in range(2))
    return q, k, v, torch.ones(1, 1, 1, keys, dtype=torch.bool)


def _median_ms(routes: dict[str, Any], inputs: tuple[torch.Tensor, ...], calls: int) -> dict[str, float]:
    """Each route's median CPU ms a call, the routes interleaved call after call."""
    times: dict[str, list[float]] = {name: [] for name in routes}
    for _ in range(calls):
        for name, call in routes.items():
            start = time.process_time()
            call(*inputs)
            times[name].append(time.process_time() - start)
    return {f"{name}_ms": round(1e3 * statistics.median(t), 3) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    args = parser.parse_args()
    import fx_rewrites
    from fx_rewrites import testing
    from fx_rewrites.backends.iree import IreeBackend

    torch.set_num_threads(1)
    heads, kv, size, keys = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    inputs = _inputs(heads, kv, size, keys, g)
    shorter = _inputs(heads, kv, size, keys - 300 if keys > 600 else keys // 2, g)
    dim = torch.export.Dim("keys", min=2, max=4096)
    backend = IreeBackend(driver="local-sync")
    row: dict[str, Any] = {"shape": args.shape, "heads": heads, "kv_heads": kv, "head_size": size, "keys": keys}
    without = IreeBackend(driver="local-sync", rules=backend.rules.without("attention_one_query_as_grouped_sums"))
    forms = {
        "rules": (Sdpa(), backend),
        "repeat_kv": (RepeatKv(), backend),
        "repeat_kv_copied": (RepeatKv(copied=True), backend),
        "without_rule": (Sdpa(), without),
        "grouped_sum": (GroupedSum(), backend),
    }
    routes: dict[str, Any] = {}
    for name in args.routes:
        module, route = forms[name]
        program = testing.export(module, *inputs, dynamic_shapes=({}, {2: dim}, {2: dim}, {3: dim}))
        routes[name] = route.compile(fx_rewrites.apply(program, route.rules).program, inputs)
        row[f"{name}_max_abs_diff"] = max(float((routes[name](*x) - Sdpa()(*x)).abs().max()) for x in (inputs, shorter))
        for _ in range(3):
            routes[name](*inputs)
    routes |= {"eager": Sdpa(), "eager_packed": EagerPacked()}
    packed = max(float((EagerPacked()(*x) - Sdpa()(*x)).abs().max()) for x in (inputs, shorter))
    row["eager_packed_max_abs_diff"] = packed
    print(json.dumps(row | _median_ms(routes, inputs, args.calls) | {"load": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
