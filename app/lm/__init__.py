"""`fx_rewrites.compile_lm`: a transformers causal LM to one IREE module that generates.

    lm = fx_rewrites.compile_lm(model, max_cache_len=256, batch_size=2)
    out = lm.generate(input_ids, attention_mask=mask, max_new_tokens=32)   # == model.generate(same arguments)
    lm.save("lm.vmfb")                                                     # and lm.irpa: the weights
    fx_rewrites.load("lm.vmfb").generate(input_ids, ...)

The model is wrapped with a static KV cache held as buffers (`export.CachedLM`), or, for a model whose
cache is a recurrent state (Mamba2), with that state held as buffers (`recurrent.RecurrentLM`); the wrapper
is exported twice over the same instance (prefill with the prompt length dynamic, decode with one token), the
backend's rules are applied to each, and the backend compiles both into one module (its `ModuleBackend`
capability, `backends.base`; IREE's is `backends/iree/functions.py`): the weights are parameters declared
once, the cache is mutable globals both functions update, so it stays in the module between calls.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import attrs
import torch

from fx_rewrites.app.distributed import compile_segmented, is_tensor_parallel, rank_and_world
from fx_rewrites.app.lm.export import CachedLM, export_lm
from fx_rewrites.app.lm.generate import FUNCTIONS, LM_KEY, CompiledLM, LMInfo, _ids, check_chunk_size
from fx_rewrites.app.lm.recurrent import SHORT_PREFILL, RecurrentLM, cache_kind, export_recurrent, prompt_multiple
from fx_rewrites.app.lm.sampling import generation_config_json
from fx_rewrites.backends.collectives import has_collectives


def _info(model: Any, max_cache_len: int, batch_size: int, recurrent: bool, short: bool) -> LMInfo:
    config = getattr(model, "generation_config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None)
    eos = _ids(getattr(config, "eos_token_id", None))
    multiple = prompt_multiple(model) if recurrent else 1
    positions = getattr(model.config, "max_position_embeddings", None)  # as model.generate reads it
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    return LMInfo(
        max_cache_len,
        batch_size,
        None if pad is None else int(pad),
        eos,
        recurrent,
        multiple,
        short,
        generation_config_json(model),
        None if positions is None else int(positions),
        None if vocab is None else int(vocab),
    )


def _wrap(model: Any, max_cache_len: int, batch_size: int, strict: bool) -> tuple[dict[str, Any], bool]:
    """The exported prefill and decode of `model` with its cache as buffers, and whether it is recurrent."""
    kind = cache_kind(model)
    if kind == "hybrid":
        raise NotImplementedError(
            f"{type(model).__name__} has both key/value cache layers and recurrent (linear attention) ones; "
            "compile_lm takes one kind or the other so far (Llama, Qwen3, ... or Mamba2). Fix: fx_rewrites.compile "
            "on an exported step of the model"
        )
    if kind == "attention":
        return export_lm(CachedLM(model, max_cache_len=max_cache_len, batch_size=batch_size), strict=strict), False
    if getattr(model.config.get_text_config(), "use_bias", False):
        raise NotImplementedError(
            f"{type(model).__name__} has a bias in its input projection (config.use_bias=True): the prefill pads "
            "the prompt to a multiple of the scan's chunk, and with the bias padding would change the "
            "convolution's first outputs. Fix: fx_rewrites.compile on an exported step of the model"
        )
    wrapper = RecurrentLM(model, max_cache_len=max_cache_len, batch_size=batch_size)
    return export_recurrent(wrapper, strict=strict), True


def compile_lm(
    model: torch.nn.Module,
    *,
    max_cache_len: int,
    batch_size: int = 1,
    backend: str | Any = "iree",
    dtype: torch.dtype | None = None,
    strict: bool = False,
    cpu: str | None = None,
    prefill_chunk_size: int | None = None,
) -> CompiledLM:
    """Compile a transformers causal LM (`LlamaForCausalLM`, ...) with a static KV cache of `max_cache_len`
    positions for `batch_size` sequences into one module with `prefill` and `decode` functions sharing the
    weights and the cache. A model whose cache is a recurrent state (`Mamba2ForCausalLM`) keeps that state
    instead: `max_cache_len` then bounds the prompt only (padded to a multiple of the model's chunk, at least
    two), and generation is unbounded. `dtype`: compile a copy of the model in that dtype (the model is left
    as is); `strict`: torch.export's strict mode (both work); `cpu`: the CPU to build for, as for
    `fx_rewrites.compile` ("x86-64-v3", "aarch64", ...; code this machine cannot run is not loaded: it saves);
    `prefill_chunk_size`: `generate`'s default for it (a longer prompt prefilled in calls of this many tokens,
    2..max_cache_len; None: in one call; ignored for a recurrent state). Returns a `CompiledLM` (`generate`, `save`)."""
    from fx_rewrites import backends
    from fx_rewrites.api import apply
    from fx_rewrites.backends.base import for_cpu
    from fx_rewrites.program import quiet_torch_pytree

    chosen = backends.get(backend) if isinstance(backend, str) else backend
    target = for_cpu(chosen, cpu)
    if not isinstance(target, backends.ModuleBackend):
        raise ValueError(
            f"compile_lm builds one module with prefill and decode functions; backend {target.name!r} cannot "
            "compile several functions into one module (backends.ModuleBackend). Fix: backend='iree' (or an "
            "IreeBackend)"
        )
    if not hasattr(model, "config") or not hasattr(model.config, "get_text_config"):
        raise TypeError(
            f"compile_lm takes a transformers causal LM (a PreTrainedModel such as LlamaForCausalLM), got "
            f"{type(model).__name__}; for another module use fx_rewrites.compile"
        )
    if max_cache_len < 2 or batch_size < 1:
        raise ValueError(f"max_cache_len={max_cache_len}, batch_size={batch_size}: expected >= 2 and >= 1")
    if prefill_chunk_size is not None:
        check_chunk_size(prefill_chunk_size, LMInfo(max_cache_len, batch_size))
    if dtype is not None and dtype != model.dtype:
        model = copy.deepcopy(model).to(dtype)
    with quiet_torch_pytree():
        split = is_tensor_parallel(model)
        if split:  # a rank of a tensor-parallel model: its local programs, cut at their collectives
            min_prompt = max(2, rank_and_world()[1])
            exported, recurrent = export_rank_lm(model, max_cache_len, batch_size, min_prompt), False
        else:
            exported, recurrent = _wrap(model, max_cache_len, batch_size, strict)
        info = _info(model, max_cache_len, batch_size, recurrent, SHORT_PREFILL in exported)
        if split:
            info = attrs.evolve(info, min_prefill=min_prompt)
        if prefill_chunk_size is not None and not recurrent:
            info = attrs.evolve(info, prefill_chunk_size=check_chunk_size(prefill_chunk_size, info))
        results = {name: apply(program, target.rules) for name, program in exported.items()}
        for result in results.values():
            result.report.warn_unless_converged(target.name)
        programs = {name: result.program for name, result in results.items()}
        if split or any(has_collectives(p) for p in programs.values()):  # collectives traced from the model's code
            module = compile_segmented(target, programs, metadata={LM_KEY: info.to_json()}, weights_as_parameters=True)
            return CompiledLM(info, module, programs, {name: r.report for name, r in results.items()})
        module = target.compile_module(
            programs,
            metadata={"prefill": {LM_KEY: info.to_json()}},
            # every weight a parameter, whatever its size: one copy, outside the module text (the cache state
            # starts from parameters of its own names whatever the limit)
            weights_as_parameters=True,
            same_state=True,
            # every generate starts with a prefill that writes the cache it reads: after save(params=) the module
            # may start over on the archive it wrote (`runtime.reopen`), its own packed copy freed
            state_restarts=True,
        )
    reports = {name: result.report for name, result in results.items()}
    compiled = CompiledLM(info, module, programs, reports, cpu=getattr(target, "cpu", None))
    if isinstance(target, backends.CpuTargets):
        options = {
            "max_cache_len": max_cache_len,
            "batch_size": batch_size,
            "dtype": dtype,
            "strict": strict,
            "prefill_chunk_size": prefill_chunk_size,
        }
        compiled.retarget = functools.partial(compile_lm, model, backend=chosen, **options)
    return compiled


def export_rank_lm(model: Any, max_cache_len: int, batch_size: int, min_prompt: int = 2) -> dict[str, Any]:
    """This rank's prefill and decode of a tensor-parallel `model` (`CachedLM` over the same instance, each
    exported with its DTensor weights flattened into local shards and its redistributions as collectives).
    `min_prompt`: the shortest prefill (DTensor's sharding rules guard the prompt length to the world size at
    least: shorter prompts are left-padded by `generate`)."""
    from fx_rewrites.app.distributed import _dtensor_spec_constant, local_program

    with _dtensor_spec_constant():
        wrapper = CachedLM(model, max_cache_len=max_cache_len, batch_size=batch_size)
        exported = export_lm(wrapper, min_prompt=min(min_prompt, max_cache_len))
        shared: dict[str, torch.Tensor] = {}  # prefill's weights are decode's: one copy in the module
        return {name: local_program(program, shared) for name, program in exported.items()}


def has_lm(reflections: dict[str, dict[str, str]]) -> bool:
    """Whether one function of a module file carries `compile_lm`'s entry (a rank's module has it on its first)."""
    return any(LM_KEY in entries for entries in reflections.values())


def is_lm(reflections: dict[str, dict[str, str]]) -> bool:
    """Whether a module file's function metadata (`ModuleBackend.read_metadata`) is `compile_lm`'s."""
    return LM_KEY in reflections.get("prefill", {}) and "decode" in reflections


def load_lm(
    path: str | os.PathLike[str],
    *,
    params: str | os.PathLike[str] | None = None,
    driver: str | None = None,
    backend: str | Any = "iree",
    module: Any = None,
    metadata: dict[str, dict[str, str]] | None = None,
) -> CompiledLM:
    """A `CompiledLM` saved with `.save(path)` (its weights from `params`, default the .irpa beside it).
    `module` / `metadata`: a rank's module already loaded (`distributed.load_segmented`) and the file's metadata."""
    from fx_rewrites import backends

    if module is not None:
        entry = next(entries[LM_KEY] for entries in (metadata or {}).values() if LM_KEY in entries)
        return CompiledLM(LMInfo.from_json(entry), module)
    target = backends.get(backend) if isinstance(backend, str) else backend
    info = LMInfo.from_json(target.read_metadata(path)["prefill"][LM_KEY])
    names = (*FUNCTIONS, SHORT_PREFILL) if info.short_prefill else FUNCTIONS
    return CompiledLM(info, target.load_file(path, names, params=params, driver=driver))


__all__ = [
    "CachedLM",
    "CompiledLM",
    "LMInfo",
    "RecurrentLM",
    "compile_lm",
    "export_lm",
    "export_rank_lm",
    "export_recurrent",
    "has_lm",
    "is_lm",
    "load_lm",
]
