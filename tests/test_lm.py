"""`fx_rewrites.compile_lm` (issue 26): a tiny Llama as one IREE module, prefill + decode sharing weights and the
KV cache; `generate` equals `model.generate(do_sample=False)` token for token, in process and after save + load.

Two compiles (batch 2 non-strict, batch 1 strict), each two programs in one module: about a minute.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import fx_rewrites

pytestmark = pytest.mark.slow

NEW = 32
CACHE = 48
#: the smallest gap between the best and second-best logit at any greedy step, for the comparison to mean
#: something: float32 differences between IREE and torch (~1e-6 here) cannot flip a choice this far apart
MARGIN = 1e-3


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.15,  # logits far enough apart that greedy choices do not tie
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def prompts(batch: int, length: int = 7, padded: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts avoiding the pad and eos tokens; with batch 2 the second row is left-padded by `padded`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :padded] = 0
        mask[1, :padded] = 0
    return ids, mask


def reference(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kwargs) -> torch.Tensor:
    """HF's greedy tokens, after checking that no step's choice is within MARGIN of a tie."""
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    for step, scores in enumerate(out.scores):
        top = scores.topk(2, dim=-1).values
        gap = (top[:, 0] - top[:, 1]).min().item()
        assert gap > MARGIN, f"step {step}: greedy choice within {gap:.2g} of a tie; pick another seed"
    return out.sequences


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def lm2(llama):
    return fx_rewrites.compile_lm(llama, max_cache_len=CACHE, batch_size=2)


@pytest.fixture(scope="module")
def lm1(llama):
    return fx_rewrites.compile_lm(llama, max_cache_len=CACHE, batch_size=1, strict=True)


@pytest.fixture(scope="module")
def saved(lm2, tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "lm.vmfb"
    lm2.save(path)
    return path


def test_batch_two_left_padded_matches_generate(llama, lm2):
    ids, mask = prompts(2)
    want = reference(llama, ids, mask)
    assert torch.equal(lm2.generate(ids, attention_mask=mask, max_new_tokens=NEW), want)
    # the cache position restarts with each call: a second generate gives the same tokens
    assert torch.equal(lm2.generate(ids, attention_mask=mask, max_new_tokens=NEW), want)
    # without a mask, the padding is inferred from the pad token, as transformers does
    assert torch.equal(lm2.generate(ids, max_new_tokens=NEW), llama.generate(ids, max_new_tokens=NEW, do_sample=False))
    assert torch.equal(lm2.generate(ids, max_new_tokens=NEW), want)


def test_batch_one_strict_export_matches_generate(llama, lm1):
    ids, mask = prompts(1)
    want = reference(llama, ids, mask)
    assert torch.equal(lm1.generate(ids, max_new_tokens=NEW), want)
    one = ids[:, :1]  # a one-token prompt goes through decode
    assert torch.equal(lm1.generate(one, max_new_tokens=8), llama.generate(one, max_new_tokens=8, do_sample=False))


def test_fewer_rows_than_compiled(llama, lm2):
    ids, mask = prompts(1, seed=3)
    assert torch.equal(lm2.generate(ids, max_new_tokens=NEW), reference(llama, ids, mask))
    free = reference(llama, ids, mask)
    eos = free[0, ids.shape[1] + 2].item()  # the row ends early: the filler row must not keep the batch going
    want = reference(llama, ids, mask, eos_token_id=eos)
    assert want.shape[1] < free.shape[1]
    assert torch.equal(lm2.generate(ids, max_new_tokens=NEW, eos_token_id=eos), want)


def test_rows_stop_at_eos_and_are_padded(llama, lm2):
    """An eos token one row reaches before the other: that row is padded after it, as HF does."""
    ids, mask = prompts(2, seed=5)
    free = reference(llama, ids, mask)
    first = free[0, ids.shape[1] + 4].item()  # row 0's fifth new token: its end
    want = reference(llama, ids, mask, eos_token_id=first)
    got = lm2.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=first)
    assert torch.equal(got, want)
    assert (got[0, ids.shape[1] + 5 :] == llama.generation_config.pad_token_id).all()


def test_save_and_load(llama, lm2, saved):
    assert saved.with_suffix(".irpa").is_file()
    loaded = fx_rewrites.load(saved)
    assert isinstance(loaded, fx_rewrites.CompiledLM)
    ids, mask = prompts(2)
    want = reference(llama, ids, mask)
    assert torch.equal(loaded.generate(ids, attention_mask=mask, max_new_tokens=NEW), want)
    # the compiled LM moved onto the archive it saved (`runtime.reopen`, its own packed copy freed): its cache
    # started over, which each generate fills from its prefill, so it gives the same tokens
    archive = saved.with_suffix(".irpa").resolve()
    assert [f.reads for f in lm2.module.functions.values()] == [archive] * len(lm2.module.functions)
    assert torch.equal(lm2.generate(ids, attention_mask=mask, max_new_tokens=NEW), want)


def test_saved_weights_are_written_once(llama, saved):
    """The archive holds each weight once, though prefill and decode both read it packed: IREE hoists a packing
    per function and merges them after the encoder is split out (docs/iree-3.13-findings.md section 33), so without
    `encoding.SHARE_PACKED` the encoder wrote every packed weight twice (1.9x the weights here)."""
    from iree.runtime import ParameterIndex

    index = ParameterIndex()
    index.load(str(saved.with_suffix(".irpa")))
    entries = dict(index.items())
    weights = sum(p.numel() * p.element_size() for p in llama.parameters())
    cache = [key for key in entries if key.startswith("cache_")]
    assert len(cache) == 4 and all(entries[k].length < weights / 4 for k in cache)  # keys and values, 2 layers
    written = sum(entry.length for key, entry in entries.items() if key not in cache)
    assert written < 1.2 * weights, f"{written} bytes of weights written for {weights}: {sorted(entries)}"
    assert written >= weights  # and none left out (the loaded module's tokens: the next tests)


def test_load_in_a_fresh_process(llama, saved, tmp_path):
    """`fx_rewrites.load` in a new Python process (nothing of this one's state): the same tokens."""
    ids, mask = prompts(2)
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    script = (
        "import sys, torch, fx_rewrites\n"
        "inputs = torch.load(sys.argv[2])\n"
        "out = fx_rewrites.load(sys.argv[1]).generate(inputs['ids'], attention_mask=inputs['mask'], "
        f"max_new_tokens={NEW})\n"
        "torch.save(out, sys.argv[3])\n"
    )
    argv = [sys.executable, "-c", script, str(saved), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), reference(llama, ids, mask))


def test_weights_are_parameters_declared_once(lm2):
    mlir = lm2.mlir
    for function in ("prefill", "decode"):
        assert f"func.func @{function}(" in mlir and f"func.func private @{function}$body(" in mlir
    declared = [line for line in mlir.splitlines() if line.lstrip().startswith("util.global private")]
    names = sorted(lm2.parameters)
    assert "model.model.embed_tokens.weight" in names and "model.lm_head.weight" in names
    for key in names:  # one declaration per weight, read by both functions
        assert sum(f'#stream.parameter.named<"model"::"{key}">' in line for line in declared) == 1, key
    state = [line for line in declared if "private mutable" in line]
    assert len(state) == 6  # keys, values and the write position of 2 layers, once each
    # each starts from a copy of a parameter of its own name, never from an inline value (IREE 3.13 gives equal
    # inline initial values one storage: tests/backends/iree/test_equal_state.py)
    initial = [line for line in declared if "__initial = #stream.parameter.named" in line]
    assert len(initial) == 6 and not any(" = " in line for line in state)
    assert len(lm2.programs["prefill"].graph_signature.buffers_to_mutate) == 6
    assert "dense_resource" not in mlir and 'torch.vtensor.literal(dense<"0x' not in mlir  # no weight bytes inline


def test_decode_continues_from_the_prefill_cache(llama, lm2):
    """decode reads what prefill wrote (the cache is shared): its logits are the model's on the whole sequence."""
    ids, _ = prompts(2, seed=7)
    length = ids.shape[1]
    mask = torch.ones(2, CACHE, dtype=torch.long)
    positions = torch.arange(length).expand(2, length)
    lm2.prefill(ids, mask, positions, torch.tensor([0]))
    token = torch.tensor([[5], [6]])
    got = lm2.decode(token, mask, torch.full((2, 1), length), torch.tensor([length]))
    with torch.no_grad():
        want = llama(torch.cat([ids, token], 1)).logits[:, -1:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # and another prompt's cache gives other logits: decode does read it
    lm2.prefill(ids.flip(1), mask, positions, torch.tensor([0]))
    other = lm2.decode(token, mask, torch.full((2, 1), length), torch.tensor([length]))
    assert (other - want).abs().max() > 1e-2


def test_iree_run_module_runs_one_decode_step(llama, saved, tmp_path):
    """The documented command (docs/deploy.md): one decode step of token 5 at cache position 0, from the saved
    initial (empty) cache, gives the model's logits for that one token."""
    tool = shutil.which("iree-run-module")
    assert tool, "iree-run-module (iree-base-runtime) is not on PATH: pip install -e '.[iree]'"
    argv = [tool, "--device=local-task", f"--module={saved}", "--function=decode"]
    argv += [f"--parameters=model={saved.with_suffix('.irpa')}"]
    argv += ["--input=2x1xi64=5", f"--input=2x{CACHE}xi64=1", "--input=2x1xi64=0", "--input=1xi64=0"]
    argv += [f"--output=@{tmp_path / 'logits.npy'}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.from_numpy(np.load(tmp_path / "logits.npy"))
    with torch.no_grad():
        want = llama(torch.tensor([[5], [5]])).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_errors_say_what_to_change(lm1):
    ids, _ = prompts(2)
    with pytest.raises(ValueError, match="batch_size=2"):
        lm1.generate(ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="cache positions"):
        lm1.generate(ids[:1], max_new_tokens=CACHE)


def test_a_decode_step_attends_to_the_written_positions_only(llama):
    """The cache is written as one slice at the call's position (not transformers' index_copy_, a scatter IREE runs
    as a copy of the whole cache); a decode step's attention reads the positions written so far (a length read
    from `cache_position`), a prompt's the whole cache."""
    from fx_rewrites.app.lm.export import CachedLM, export_lm

    programs = export_lm(CachedLM(llama, max_cache_len=CACHE, batch_size=1))
    aten = torch.ops.aten

    def key_lengths(program) -> list:
        nodes = program.graph_module.graph.nodes
        return [n.args[1].meta["val"].shape[-2] for n in nodes if n.target == aten.scaled_dot_product_attention.default]

    assert key_lengths(programs["prefill"]) == [CACHE] * llama.config.num_hidden_layers
    decode = key_lengths(programs["decode"])
    assert len(decode) == llama.config.num_hidden_layers
    assert all(isinstance(k, torch.SymInt) for k in decode), decode
    for name, program in programs.items():
        targets = {n.target for n in program.graph_module.graph.nodes}
        assert aten.index_copy_.default not in targets and aten.index_copy.default not in targets, name
        assert aten.slice_scatter.default in targets, name


def test_a_long_prompt_prefilled_in_chunks_matches_generate(llama, lm2):
    """`prefill_chunk_size`: a left-padded prompt of 21 in calls of 8 tokens (at 0, 8 and 13: the last overlaps
    the one before, all of one size) and of 5 (a length not a multiple of it) gives model.generate's tokens; the
    calls are what `chunk_starts` says."""
    from fx_rewrites.app.lm.generate import chunk_starts

    ids, mask = prompts(2, length=21, padded=4, seed=7)
    want = reference(llama, ids, mask)[:, : 21 + 16]
    functions = lm2.module.functions
    prefill = functions["prefill"]
    calls: list[tuple[int, int]] = []

    def spy(ids, mask, positions, start):
        calls.append((ids.shape[1], int(start[0])))
        return prefill(ids, mask, positions, start)

    functions["prefill"] = spy
    try:
        for chunk in (8, 5, 21, None):
            calls.clear()
            got = lm2.generate(ids, attention_mask=mask, max_new_tokens=16, prefill_chunk_size=chunk)
            assert torch.equal(got, want), chunk
            expected = [(chunk, s) for s in chunk_starts(21, chunk)] if chunk and chunk < 21 else [(21, 0)]
            assert calls == expected, (chunk, calls)
        assert chunk_starts(21, 8) == [0, 8, 13]
    finally:
        functions["prefill"] = prefill


def test_prefill_chunk_size_default_and_errors(llama):
    """compile_lm's `prefill_chunk_size` is generate's default (kept in the saved module's info) and checked."""
    from fx_rewrites.app.lm.generate import LMInfo

    info = LMInfo(CACHE, 1, prefill_chunk_size=16)
    assert LMInfo.from_json(info.to_json()) == info
    assert LMInfo.from_json(LMInfo(CACHE, 1).to_json()).prefill_chunk_size is None
    for bad in (1, 0, CACHE + 1, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk_size"):
            fx_rewrites.compile_lm(llama, max_cache_len=CACHE, prefill_chunk_size=bad)


def test_a_bad_chunk_size_in_generate_says_what_fits(lm1):
    ids, _ = prompts(1, length=9)
    with pytest.raises(ValueError, match=f"from 2 .* to {CACHE}"):
        lm1.generate(ids, max_new_tokens=2, prefill_chunk_size=1)
