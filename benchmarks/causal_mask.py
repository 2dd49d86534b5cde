"""The static-cache prefill's causal mask alone (issue 34): transformers' form (`sdpa_mask`'s padding function reads
the attention mask gathered by an `arange` of the keys) through the `iree` route without `index_by_arange_as_view`
(the gather IREE compiles), through the route (the rule reads the mask as the dimension), and the mask written by
hand as the dimension; IREE (local-sync), a Dim on the rows, one thread, CPU ms, median of 9 interleaved calls. Each
is checked equal to transformers' form on 2048 and 300 rows. docs/iree-3.13-findings.md, "A gather by an `arange`".

    python benchmarks/causal_mask.py
"""

import statistics
import time

import torch
from torch.export import Dim

import fx_rewrites
from fx_rewrites import backends

RULE = "index_by_arange_as_view"

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
    from benchmarks.cpu_isa import without

    route = backends.get("iree")
    assert RULE in [r.name for r in route.rules.rules]
    routes = {
        "gathered, without the rule": (Gathered(), without(route, RULE)[f"-{RULE}"]),
        "gathered, the route": (Gathered(), route),
        "sliced by hand": (Sliced(), route),
    }
    fns = {}
    for name, (m, backend) in routes.items():
        fns[name] = fx_rewrites.compile(m, (cp, am), backend=backend, dynamic_shapes=({0: rows}, None))
        print(name, f"{RULE} fired {fns[name].report.rewrites.get(RULE, 0)} time(s)", flush=True)
        assert torch.equal(fns[name](cp, am), Gathered()(cp, am))
        assert torch.equal(fns[name](cp[:300], am), Gathered()(cp[:300], am))
    times = {k: [] for k in fns}
    for _ in range(9):
        for k, f in fns.items():
            t = time.process_time()
            f(cp, am)
            times[k].append(time.process_time() - t)
    print({k: round(1e3 * statistics.median(v), 2) for k, v in times.items()}, flush=True)


if __name__ == "__main__":
    main()
