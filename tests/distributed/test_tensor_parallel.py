"""A Llama split with torch's tensor-parallel API over gloo ranks on this machine: each rank's graphs on IREE,
the collectives on torch.distributed, through torch.compile and through compile_lm (save + load per rank)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import ranks
from tests.distributed.launch import run_ranks


def _check_routes(results: list[dict], world: int, new: int, layers: int) -> None:
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: torch.compile {r['compile_seconds']:.1f} s, compile_lm {r['lm_seconds']:.1f} s, "
            f"logits {r['logit_errors']}, irpa {r['irpa']}, weights {r['local_weights']} of {r['weights']} bytes "
            f"(KV cache {r['kv_cache']}), compiles {r['lm_compiles']} of {r['lm_lookups']} lookups"
        )
        # torch.compile: every graph compiled (no eager fallback), one host round trip per collective
        assert all(not g["fallback"] for g in r["graphs"]), r["graphs"]
        main = max(r["graphs"], key=lambda g: g["collectives"])
        assert main["collectives"] == 2 * layers  # an all_reduce after attention's o_proj and after the MLP
        assert main["round_trips"] == main["collectives"]
        assert len(main["functions"]) == main["collectives"] + 1
        assert main["frozen"] > 0  # the local shards are compiled in as constants
        assert max(r["logit_errors"]) < 1e-4, (rank, r["logit_errors"])
        # compile_lm: the unsplit model's greedy tokens, before and after this rank's save + load
        assert r["want_tokens"].shape[1] == ranks.PROMPT + new
        assert torch.equal(r["tokens"], r["want_tokens"]), (rank, r["tokens"], r["want_tokens"])
        assert torch.equal(r["loaded_tokens"], r["want_tokens"])
        assert torch.equal(r["short_tokens"], r["want_short"]), (rank, r["short_tokens"], r["want_short"])
        for functions, collectives in r["lm_plans"].values():
            assert collectives == 2 * layers and len(functions) == collectives + 1
        # the rank's archive holds its shards once (the norms, embeddings and head whole, the rest 1/world of
        # each matrix) and the KV cache's initial state
        assert r["local_weights"] <= r["module_weights"] <= r["local_weights"] + r["buffers"], r
        share = r["local_weights"] / r["weights"]  # the split weights 1/world, the embeddings, head and norms whole
        assert share < 0.5 + 0.5 / world + 0.2
        # the archive (weights packed as the module reads them, the KV cache, the rank's record) is what the rank
        # holds, within 10%: its shards, not the whole model's weights
        held = r["local_weights"] + r["buffers"] + r["kv_cache"]
        assert r["local_weights"] < r["irpa"] < held * 1.1, (r["irpa"], held)
        # another rank's files, or this rank's module with another rank's archive: refused by name
        theirs = (rank + 1) % world
        assert f"is rank {theirs}'s module" in r["other_file"] and f"loaded on rank {rank}" in r["other_file"]
        assert f"is rank {theirs}'s module" in r["other_archive"], r["other_archive"]
    # one compile for every rank: the module files are the same (the rank is in its archive), and the ranks together
    # compiled one rank's modules, the module and at save its packed form (its encoder compiled with it); the others
    # waited on the cache entry's lock and read them (each compiling its own: 2 a rank)
    assert len({r["vmfb"] for r in results}) == 1
    assert sum(r["lm_compiles"] for r in results) <= 2, [r["lm_compiles"] for r in results]


def _refused_in_a_world_of_one(path) -> None:
    """A rank's file (saved by a world of 2) is refused in a world of one, before anything is loaded."""
    import torch.distributed as dist

    import fx_rewrites
    from fx_rewrites.app.distributed import RankMismatch
    from tests.distributed.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(RankMismatch, match=r"compiled for a world of 2 ranks .* this one has 1"):
            fx_rewrites.load(path)
    finally:
        dist.destroy_process_group()


# The sizes (issue 35, whose done-when keeps them in CI): hidden 256 on 2 ranks, 512 on 4 ranks, 24 tokens.
# The 2-rank launch also checks the refusals of another rank's files (compile_lm's and fx_rewrites.compile's) and
# of a world of one: a tiny (hidden 64) launch of its own once proved these and both routes again, 190 CPU s.
def test_two_ranks_llama_256_both_routes_and_the_named_refusals(tmp_path) -> None:
    """The issue's model: hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 512, 24 greedy tokens, 2 ranks (one
    launch): both routes, then each rank loading the other's files refused, and a world of one refused."""
    results = run_ranks(ranks.routes_and_refusals, 2, 256, 4, 8, 4, 24, tmp=tmp_path)
    _check_routes([r["routes"] for r in results], 2, 24, 4)
    for rank, r in enumerate(r["compile"] for r in results):
        assert f"is rank {1 - rank}'s module" in r["rank"] and f"loaded on rank {rank}" in r["rank"], r["rank"]
        assert r["same"] == 0.0
    _refused_in_a_world_of_one(tmp_path / "m.rank0.vmfb")
    _refused_in_a_world_of_one(tmp_path / "lm.rank0.vmfb")


# Marked slow: left out of a plain pytest (CI runs it). 2 layers, not the 4: a layer is the same split
# again (its two all_reduces), and the 2-rank test above keeps the 4; at 4 layers this test took 316 CPU s,
# the most of any test in CI (AMD EPYC, AVX2, 2 cores).
@pytest.mark.slow
def test_four_ranks_llama_512() -> None:
    """The same on 4 ranks with hidden 512, 2 layers (4 processes on this machine's 2 cores): one KV head a rank."""
    results = run_ranks(ranks.llama_routes, 4, 512, 2, 8, 4, 24)
    _check_routes(results, 4, 24, 2)


def test_point_to_point_falls_back_naming_the_op() -> None:
    results = run_ranks(ranks.isend_in_forward, 2)
    for rank, r in enumerate(results):
        op = "isend" if rank == 0 else "irecv"
        assert any(f"`_c10d_functional.{op}.default`" in m for m in r["warnings"]), r["warnings"]
        assert any("point-to-point" in m for m in r["warnings"])
        assert torch.equal(r["got"], r["want"]), (rank, r["got"], r["want"])
        if rank == 1:  # what rank 0 sent: its x * 2
            assert torch.equal(r["got"], torch.arange(6.0).reshape(2, 3) * 2 + 1)
        # torch.export keeps funcol's in-place all_reduce_: compiling it names the op and why
        assert r["inplace"].startswith("_c10d_functional.all_reduce_.default:"), r["inplace"]
        assert "writes into its argument" in r["inplace"]
