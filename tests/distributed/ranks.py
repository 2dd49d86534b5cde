"""What each rank runs in the distributed tests (module-level functions: spawn imports them by name)."""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

#: the prompt every test generates from: (1, PROMPT) ids drawn with seed 1
PROMPT = 7


def llama(hidden: int, layers: int, heads: int = 8, kv_heads: int = 4, vocab: int = 512) -> Any:
    """A seeded LlamaForCausalLM (no download): weights from manual_seed(0), initializer_range 0.1, no eos."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        initializer_range=0.1,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


def tp_plan(model: Any) -> dict[str, Any]:
    """Megatron-style: q, k, v, gate, up column-wise; o and down row-wise (an all_reduce after each)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.model.layers)):
        layer = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[layer + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[layer + name] = RowwiseParallel()
    return plan


def split(model: Any, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, init_device_mesh("cpu", (world,)), tp_plan(model))


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 512, (1, PROMPT), generator=g), torch.randint(1, 512, (1, PROMPT), generator=g)


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def llama_routes(rank: int, world: int, tmp: str, hidden: int, layers: int, heads: int, kv: int, new: int) -> dict:
    """Both routes on one rank of a Llama split over `world` ranks, against the unsplit model's eager results;
    then the named refusals of another rank's files (each rank saves its own first)."""
    import fx_rewrites
    from fx_rewrites import backends
    from fx_rewrites.app.distributed import RankMismatch
    from fx_rewrites.backends.dynamo import dynamo_backend

    model = llama(hidden, layers, heads, kv)
    ids, other = prompts()
    with torch.no_grad():
        want = [model(x, use_cache=False).logits for x in (ids, other)]
        want_tokens = model.generate(ids, max_new_tokens=new, do_sample=False)
        want_short = model.generate(ids[:, :2], max_new_tokens=4, do_sample=False)
    weights = _nbytes(model.state_dict().values())
    split(model, world)
    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    out: dict[str, Any] = {"weights": weights, "local_weights": _nbytes(local), "want_tokens": want_tokens}
    out["buffers"] = _nbytes(model.buffers())  # rotary frequencies: read by the module, not split
    # the static KV cache's initial state (keys and values of every layer, this rank's KV heads): in the archive too
    out["kv_cache"] = 2 * layers * (kv // world) * (PROMPT + new) * (hidden // heads) * 4

    graphs: list[Any] = []
    compiled = torch.compile(model, backend=dynamo_backend("iree", on_graph=graphs.append, strict=True))
    start = time.perf_counter()
    with torch.no_grad():
        got = [compiled(x, use_cache=False).logits for x in (ids, other)]
    out["compile_seconds"] = time.perf_counter() - start
    out["logit_errors"] = [float((g - w).abs().max()) for g, w in zip(got, want)]
    out["graphs"] = [
        {
            "fallback": g.fallback,
            "functions": g.compiled.plan.functions if hasattr(g.compiled, "plan") else (),
            "collectives": g.compiled.plan.collectives if hasattr(g.compiled, "plan") else 0,
            "round_trips": g.compiled.plan.host_round_trips if hasattr(g.compiled, "plan") else 0,
            "frozen": len(g.frozen),
        }
        for g in graphs
    ]

    cache = backends.get("iree").cache
    before = cache.hits, cache.misses
    start = time.perf_counter()
    lm = fx_rewrites.compile_lm(model, max_cache_len=PROMPT + new)
    out["lm_seconds"] = time.perf_counter() - start
    out["tokens"] = lm.generate(ids, max_new_tokens=new)
    # a prompt shorter than the prefill takes on 4 ranks (DTensor guards its length to the world size): padded
    out["short_tokens"], out["want_short"] = lm.generate(ids[:, :2], max_new_tokens=4), want_short
    held = lm.parameters or {}
    out["module_weights"] = _nbytes(t for k, t in held.items() if not k.startswith("cache_"))
    out["module_state"] = _nbytes(held.values())
    path = Path(tmp) / f"lm.rank{rank}.vmfb"
    lm.save(path)
    # the compiles of the module and of its packed form at save: the same programs on every rank (the weights
    # are parameters, the rank is in the archive), each compiled by one rank while the others wait for it
    out["lm_compiles"] = cache.misses - before[1]
    out["lm_lookups"] = cache.hits + cache.misses - sum(before)
    out["vmfb"] = hashlib.sha256(path.read_bytes()).hexdigest()
    out["irpa"] = os.path.getsize(path.with_suffix(".irpa"))
    loaded = fx_rewrites.load(path)
    out["loaded_tokens"] = loaded.generate(ids, max_new_tokens=new)
    out["lm_plans"] = {k: (f.run.plan.functions, f.run.plan.collectives) for k, f in lm.module.functions.items()}
    torch.distributed.barrier()  # every rank's files are written
    theirs = Path(tmp) / f"lm.rank{(rank + 1) % world}.vmfb"
    for what, call in {
        "other_file": lambda: fx_rewrites.load(theirs),  # another rank's files
        "other_archive": lambda: fx_rewrites.load(path, params=theirs.with_suffix(".irpa")),  # its archive
    }.items():
        try:
            call()
            out[what] = "loaded"
        except RankMismatch as e:
            out[what] = str(e)
    return out


def routes_and_refusals(rank: int, world: int, tmp: str, *sizes: int) -> dict:
    """One launch for both routes (`llama_routes` at `sizes`) and `fx_rewrites.compile`'s save + load with its
    refusals (`wrong_rank`, a one-layer hidden-64 model)."""
    return {"routes": llama_routes(rank, world, tmp, *sizes), "compile": wrong_rank(rank, world, tmp)}


def wrong_rank(rank: int, world: int, tmp: str) -> dict:
    """Each rank saves a small compiled model, then loads the other rank's file (refused) and its own."""
    import fx_rewrites
    from fx_rewrites.app.distributed import RankMismatch

    model = split(llama(64, 1, 4, 2, vocab=96), world)
    ids = torch.randint(1, 96, (1, 5), generator=torch.Generator().manual_seed(1))
    compiled = fx_rewrites.compile(model, (ids,), {"use_cache": False})
    path = Path(tmp) / f"m.rank{rank}.vmfb"
    compiled.save(path, params=path.with_suffix(".irpa"))
    torch.distributed.barrier()
    other = Path(tmp) / f"m.rank{(rank + 1) % world}.vmfb"
    errors = {}
    try:
        fx_rewrites.load(other)
    except RankMismatch as e:
        errors["rank"] = str(e)
    same = fx_rewrites.load(path)
    with torch.no_grad():
        errors["same"] = float((same(ids).logits - compiled(ids).logits).abs().max())
    return errors


def isend_in_forward(rank: int, world: int, tmp: str) -> dict:
    """A point-to-point send (pipeline parallelism) traced by torch.compile: the graph falls back to eager,
    with the warning naming the op."""
    from fx_rewrites.backends.dynamo import EagerFallbackWarning, dynamo_backend

    def stage(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        if rank == 0:
            y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.isend(y, 1, 0, "0"))
        else:
            y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.irecv(y, 0, 0, "0"))
        return y + 1

    x = torch.arange(6.0).reshape(2, 3) + rank
    want = stage(x)  # torch's own: the receiver gets the sender's x * 2, the sender's isend returns no elements
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(stage, backend=dynamo_backend("iree", strict=False))(x)
    messages = [str(w.message) for w in caught if issubclass(w.category, EagerFallbackWarning)]
    return {"warnings": messages, "got": got, "want": want, "inplace": inplace_all_reduce_export()}


class InPlaceAllReduce(torch.nn.Module):
    """`_c10d_functional.all_reduce_`, which torch.export keeps as it is (torch.compile's functionalization
    refuses it before any backend sees it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        torch.ops._c10d_functional.all_reduce_(y, "sum", "0")
        return y + 1


def inplace_all_reduce_export() -> str:
    import fx_rewrites
    from fx_rewrites.backends.collectives import UnhandledCollective

    try:
        fx_rewrites.compile(InPlaceAllReduce(), (torch.ones(2, 3),))
    except UnhandledCollective as e:
        return f"{e.op}: {e}"
    return "compiled"
