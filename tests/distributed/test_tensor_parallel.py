"""A Llama split with torch's tensor-parallel API over gloo ranks on this machine: each rank's graphs on IREE,
the collectives on torch.distributed, through torch.compile and through compile_lm (save + load per rank)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import ranks
from tests.distributed.launch import run_ranks


def _check_routes(results: list[dict], world: int, new: int, layers: int) -> None:
    unsplit_irpa = results[0]["unsplit_irpa"]  # the unsplit model's archive: rank 0 compiles it for all
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: torch.compile {r['compile_seconds']:.1f} s, compile_lm {r['lm_seconds']:.1f} s, "
            f"logits {r['logit_errors']}, irpa {r['irpa']} (unsplit {unsplit_irpa}), weights "
            f"{r['local_weights']} of {r['weights']} bytes"
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
        # the archive (weights packed as the module reads them) shrinks with the weights: within 10% of that share
        assert r["irpa"] < unsplit_irpa * share * 1.1, (r["irpa"], unsplit_irpa, share)


def test_two_ranks_tiny_llama_both_routes() -> None:
    """CI: hidden 64, 2 layers, 4 heads / 2 KV heads over 2 ranks."""
    results = run_ranks(ranks.llama_routes, 2, 64, 2, 4, 2, 8)
    _check_routes(results, 2, 8, 2)


# The sizes (issue 35, whose done-when keeps them in CI): what the tiny test above proves, at hidden 256 on
# 2 ranks and 512 on 4 ranks, 24 tokens (2-4 minutes each on 2 cores). Marked slow: left out of a plain pytest.
@pytest.mark.slow
def test_two_ranks_llama_256() -> None:
    """The issue's model: hidden 256, 4 layers, 8 heads / 4 KV heads, vocab 512, 24 greedy tokens, 2 ranks."""
    results = run_ranks(ranks.llama_routes, 2, 256, 4, 8, 4, 24)
    _check_routes(results, 2, 24, 4)


@pytest.mark.slow
def test_four_ranks_llama_512() -> None:
    """The same on 4 ranks with hidden 512 (4 processes on this machine's 2 cores)."""
    results = run_ranks(ranks.llama_routes, 4, 512, 4, 8, 4, 24)
    _check_routes(results, 4, 24, 4)


def test_another_ranks_file_and_another_world_size_are_refused(tmp_path) -> None:
    import torch.distributed as dist

    import fx_rewrites
    from fx_rewrites.app.distributed import RankMismatch
    from tests.distributed.launch import free_port

    results = run_ranks(ranks.wrong_rank, 2, tmp=tmp_path)
    for rank, r in enumerate(results):
        assert f"is rank {1 - rank}'s module" in r["rank"] and f"loaded on rank {rank}" in r["rank"], r["rank"]
        assert r["same"] == 0.0
    # a world of one: rank 0's file (saved by a world of 2) is refused before anything is loaded
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(RankMismatch, match=r"compiled for a world of 2 ranks .* this one has 1"):
            fx_rewrites.load(tmp_path / "m.rank0.vmfb")
    finally:
        dist.destroy_process_group()


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
