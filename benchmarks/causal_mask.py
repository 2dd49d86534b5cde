"""The static-cache prefill's causal mask alone (issue 34): transformers' form (`sdpa_mask`'s padding function reads
the attention mask gathered by an `arange` of the keys) against the mask read as the dimension itself; IREE (the
project's rules, local-sync), a Dim on the rows, one thread, CPU ms, median of 9 interleaved calls. Both forms are
checked equal to transformers' form on 2048 and 300 rows. docs/iree-3.13-findings.md section 46.

    python benchmarks/causal_mask.py
"""

import statistics
import time

import torch
from torch.export import Dim

import fx_rewrites

K = 2053


class Gathered(torch.nn.Module):
    def forward(self, cache_position, attention_mask):
        kv = torch.arange(K)
        b = torch.arange(1)
        causal = kv[None, None, None, :] <= cache_position[None, None, :, None]
        pad = attention_mask.bool()[b[:, None, None, None], kv[None, None, None, :]]
        return (causal & pad).expand(1, 1, cache_position.shape[0], K)


class Sliced(torch.nn.Module):
    def forward(self, cache_position, attention_mask):
        kv = torch.arange(K)
        causal = kv[None, None, None, :] <= cache_position[None, None, :, None]
        pad = attention_mask.bool()[:, None, None, :]
        return (causal & pad).expand(1, 1, cache_position.shape[0], K)


def main() -> None:
    torch.set_num_threads(1)
    cp = torch.arange(2048)
    am = torch.ones(1, K, dtype=torch.int64)
    am[:, 2048:] = 0
    am[:, :3] = 0
    rows = Dim("rows", min=2, max=K)
    fns = {}
    for m in (Gathered(), Sliced()):
        fns[type(m).__name__] = fx_rewrites.compile(m, (cp, am), backend="iree", dynamic_shapes=({0: rows}, None))
        assert torch.equal(fns[type(m).__name__](cp, am), Gathered()(cp, am))
        assert torch.equal(fns[type(m).__name__](cp[:300], am), Gathered()(cp[:300], am))
    times = {k: [] for k in fns}
    for _ in range(9):
        for k, f in fns.items():
            t = time.process_time()
            f(cp, am)
            times[k].append(time.process_time() - t)
    print({k: round(1e3 * statistics.median(v), 2) for k, v in times.items()}, flush=True)


if __name__ == "__main__":
    main()
