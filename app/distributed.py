"""Tensor-parallel models through the export route: each rank's local program, cut at its collectives.

    # on every rank (torchrun --nproc-per-node 2 ...), after parallelize_module(model, mesh, plan):
    compiled = fx_rewrites.compile(model, (x,))       # the rank's program: local shards, functional collectives
    compiled(x)                                       # segments on IREE, all_reduce & co. on torch.distributed
    compiled.save(f"model.rank{rank}.vmfb", params=f"model.rank{rank}.irpa")   # this rank's shard of the weights
    fx_rewrites.load(f"model.rank{rank}.vmfb")(x)     # same rank, same world size, same collectives

torch.export cannot take a model whose weights are DTensors as it is (pytree refuses `DTensorSpec`); for the
time of the export, `DTensorSpec` is a pytree constant, the export traces the DTensor code (its
`from_local`, redistributions and `to_local`), and `run_decompositions()` flattens the DTensor weights into
their local shards (plain parameters) with the redistributions as functional collectives
(`_c10d_functional.all_reduce` + `wait_tensor`, ...). That program is cut at its collectives
(`backends/segments.py`); the backend compiles its segments as the functions of one module (weights once,
a KV cache shared), and `SegmentedModule` runs them with the collectives on torch.distributed in between.

The module file carries, as JSON in its first function's metadata, the world size it was built for and each
public function's plan (segments, host collectives, call convention): the same on every rank, so that the
ranks' programs, which differ in their weights only (parameters, outside the module text), are one compile
(the compile cache's key; concurrent ranks wait for the first: `cache.compiling`). What makes a rank's files
its own is its archive: its shards, and a record (`RANK_KEY`) of its rank and world size, which `load` checks
before anything is loaded: another rank's file, or one from a world of another size, is refused by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind

from fx_rewrites.backends import collectives, convention
from fx_rewrites.backends.base import ArtifactError
from fx_rewrites.backends.segments import PREFIX, Plan, Segmented, segment_program

#: metadata key (on a rank's module) holding its world size and plans (JSON)
TP_KEY = "fx_rewrites.tp"
#: record (in a rank's parameter archive) holding its rank and world size (JSON)
RANK_KEY = "fx_rewrites.tp.rank"


class RankMismatch(ArtifactError):
    """A rank's module file loaded on another rank, or in a world of another size."""


def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether `model` holds DTensor parameters or buffers (split with torch's tensor-parallel API)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in (*model.parameters(), *model.buffers()))


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (torch.distributed must be initialized)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "a tensor-parallel module runs its collectives on torch.distributed, which is not initialized in this "
            "process. Fix: torch.distributed.init_process_group('gloo') (or 'nccl'), as torchrun's ranks do, "
            "before compiling or loading it"
        )
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def _dtensor_spec_constant() -> Iterator[None]:
    """DTensorSpec as a pytree constant while torch.export traces DTensor code (left as it was after)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if DTensorSpec in pytree.SUPPORTED_NODES:
        yield
        return
    pytree.register_constant(DTensorSpec)
    try:
        yield
    finally:
        pytree._deregister_pytree_node(DTensorSpec)


def export_local(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
) -> ExportedProgram:
    """This rank's program of the tensor-parallel `model`: its local weight shards as plain parameters,
    its redistributions as functional collectives (non-strict torch.export, then `run_decompositions()`)."""
    with _dtensor_spec_constant(), torch.no_grad():
        program = torch.export.export(model, args, dict(kwargs or {}) or None, dynamic_shapes=dynamic_shapes)
        return local_program(program)


def local_program(program: ExportedProgram, shared: dict[str, torch.Tensor] | None = None) -> ExportedProgram:
    """`program` (exported from a tensor-parallel model) with its DTensors flattened into local shards.

    The flattening names a shard `q_proj.parametrizations.weight.original0`; it is named back after the weight
    (`q_proj.weight`). `shared`: weights by name, filled and reused, so that programs flattened one after another
    (prefill and decode) hold the same tensors, which a module of both then holds once."""
    with _dtensor_spec_constant():
        flat = program.run_decompositions()
    return _named_back(flat, {} if shared is None else shared)


def _original_name(key: str) -> str:
    return key.replace(".parametrizations.", ".").removesuffix(".original0")


def _named_back(program: ExportedProgram, shared: dict[str, torch.Tensor]) -> ExportedProgram:
    specs = [
        dataclasses.replace(s, target=_original_name(s.target)) if s.kind == InputKind.PARAMETER else s
        for s in program.graph_signature.input_specs
    ]
    state = {}
    for key, value in program.state_dict.items():
        name = _original_name(key)
        held = shared.setdefault(name, value)
        same = held.shape == value.shape and held.dtype == value.dtype and torch.equal(held, value)
        state[name] = held if same else value
    return ExportedProgram(
        root=program.graph_module,
        graph=program.graph_module.graph,
        graph_signature=ExportGraphSignature(input_specs=specs, output_specs=program.graph_signature.output_specs),
        state_dict=state,
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=program.verifiers,
    )


@attrs.define(eq=False)
class SegmentedFunction:
    """A public function of a rank's module, called like the program it came from: `convention` binds and
    checks a call (keyword constants such as `use_cache=False` may be left out), `run` runs the segments."""

    run: Segmented
    convention: convention.Plan = attrs.field(repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = convention.bind(self.convention, args, kwargs)
        return pytree.tree_unflatten(self.run.run(flat), self.convention.out_spec)

    def unchecked(self) -> Any:
        """Called with the flat inputs, returning one output (the generate loop's form)."""
        functions = {k: _unchecked(f) for k, f in self.run.functions.items()}
        fast = attrs.evolve(self.run, functions=functions)
        single = self.convention.out_spec.num_leaves == 1

        def call(*flat: Any) -> Any:
            before = fast.host_seconds, fast.host_cpu_seconds
            out = fast.run(flat)
            self.run.host_seconds += fast.host_seconds - before[0]
            self.run.host_cpu_seconds += fast.host_cpu_seconds - before[1]
            return out[0] if single else pytree.tree_unflatten(out, self.convention.out_spec)

        return call


def _convention_json(plan: convention.Plan) -> dict[str, Any]:
    inputs = [
        {
            "name": i.name,
            "path": i.path,
            "kind": i.kind,
            "dtype": None if i.dtype is None else str(i.dtype),
            "shape": list(i.shape),
            "value": i.value,
        }
        for i in plan.inputs
    ]
    return {
        "in_spec": pytree.treespec_dumps(plan.in_spec),
        "out_spec": pytree.treespec_dumps(plan.out_spec),
        "inputs": inputs,
        "ranges": {k: list(v) for k, v in plan.ranges.items()},
    }


def _convention_from_json(doc: Mapping[str, Any]) -> convention.Plan:
    def dtype(name: str | None) -> torch.dtype | None:
        return None if name is None else getattr(torch, name.removeprefix("torch."))

    inputs = tuple(
        convention.Input(i["name"], i["path"], i["kind"], dtype(i["dtype"]), tuple(i["shape"]), i["value"])
        for i in doc["inputs"]
    )
    in_spec, out_spec = pytree.treespec_loads(doc["in_spec"]), pytree.treespec_loads(doc["out_spec"])
    ranges = {k: (v[0], v[1]) for k, v in doc["ranges"].items()}
    return convention.Plan(in_spec, out_spec, tuple(range(len(inputs))), (), inputs, ranges)


def _convention(program: ExportedProgram) -> convention.Plan:
    inputs = convention.program_inputs(program)
    spec = program.call_spec
    ranges = convention.program_ranges(program)
    return convention.Plan(spec.in_spec, spec.out_spec, tuple(range(len(inputs))), (), inputs, ranges)


def _unchecked(fn: Any) -> Any:
    unchecked = getattr(fn, "unchecked", None)
    return unchecked() if callable(unchecked) else fn


@attrs.define(eq=False)
class SegmentedModule:
    """A rank's module: `functions` (public name -> SegmentedFunction) over the segments of one backend module
    (`module`: weights once, the state shared), for `rank` of `world`. `save` writes that module with the plans."""

    functions: dict[str, SegmentedFunction]
    module: Any = attrs.field(repr=False)
    rank: int
    world: int

    @property
    def parameters(self) -> Mapping[str, torch.Tensor] | None:
        return getattr(self.module, "parameters", None)

    @property
    def mlir(self) -> str:
        return getattr(self.module, "mlir", "")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the module's `main` (`fx_rewrites.compile`'s; a language model's are `prefill` and `decode`)."""
        return self.functions["main"](*args, **kwargs)

    def save(self, path: str | os.PathLike[str], *, params: str | os.PathLike[str] | None = None) -> None:
        """Write this rank's module to `path` (.vmfb) and its weights (this rank's shards) with its rank and world
        size to `params` (.irpa, default beside it); `fx_rewrites.load(path)` on the same rank of a world of the
        same size reads it back. The .vmfb is the same on every rank: the archive is the rank's own."""
        path = Path(path)
        params = Path(params) if params is not None else path.with_suffix(".irpa")
        record = json.dumps({"rank": self.rank, "world": self.world}, separators=(",", ":"))
        self.module.save(path, params=params, records={RANK_KEY: record})

    @property
    def host_seconds(self) -> float:
        return sum(f.run.host_seconds for f in self.functions.values())

    @property
    def host_cpu_seconds(self) -> float:
        return sum(f.run.host_cpu_seconds for f in self.functions.values())


def _segment_name(public: str, segment: str) -> str:
    return f"{public}_{segment}"


def compile_segmented(
    target: Any,
    programs: Mapping[str, ExportedProgram],
    *,
    metadata: Mapping[str, str] | None = None,
    weights_as_parameters: bool = False,
) -> SegmentedModule:
    """`programs` (public name -> a rank's program, rules applied) cut at their collectives and compiled by
    `target` (a `ModuleBackend`) as one module; `metadata` goes with the plans into the module file."""
    rank, world = rank_and_world()
    plans: dict[str, Plan] = {}
    segments: dict[str, ExportedProgram] = {}
    for public, program in programs.items():
        plan, pieces = segment_program(program)
        plans[public] = plan
        segments.update({_segment_name(public, name): p for name, p in pieces.items()})
    doc = {  # no rank: the module text is the same on every rank (the rank goes into its archive at save)
        "world": world,
        "functions": {
            public: {"plan": plans[public].to_json(), "call": _convention_json(_convention(programs[public]))}
            for public in programs
        },
    }
    first = next(iter(segments))
    module = target.compile_module(
        segments,
        metadata={first: {TP_KEY: json.dumps(doc, separators=(",", ":")), **(metadata or {})}},
        weights_as_parameters=weights_as_parameters,
    )
    return _assemble(doc, module, rank)


def _assemble(doc: Mapping[str, Any], module: Any, rank: int) -> SegmentedModule:
    functions = {}
    for public, entry in doc["functions"].items():
        plan = Plan.from_json(entry["plan"])
        calls = {name: module.functions[_segment_name(public, name)] for name in plan.functions}
        functions[public] = SegmentedFunction(Segmented(plan, calls), _convention_from_json(entry["call"]))
    return SegmentedModule(functions, module, rank, int(doc["world"]))


def find_tp(metadata: Mapping[str, Mapping[str, str]]) -> tuple[str, dict[str, Any]] | None:
    """The function carrying a rank's plans in a module file's metadata, and the plans; None if none does."""
    for name, entries in metadata.items():
        if TP_KEY in entries:
            return name, json.loads(entries[TP_KEY])
    return None


def _check_groups(plans: Mapping[str, Plan], path: Any) -> None:
    from torch.distributed.distributed_c10d import _resolve_process_group

    for plan in plans.values():
        for step in plan.steps:
            for name in sorted(collectives.group_names(getattr(step, "calls", ()))):
                try:
                    _resolve_process_group(name)
                except Exception as e:
                    raise RankMismatch(
                        f"{path}: its collectives run on process group {name!r}, which this process does not have "
                        f"({type(e).__name__}: {e}). Fix: create the same groups before loading (the same "
                        "init_device_mesh / new_group calls, in the same order, as when it was compiled)"
                    ) from None


def load_segmented(
    path: str | os.PathLike[str],
    metadata: Mapping[str, Mapping[str, str]],
    target: Any,
    *,
    params: str | os.PathLike[str] | None = None,
    driver: str | None = None,
) -> SegmentedModule:
    """A rank's module saved with `SegmentedModule.save`, for this process's rank: RankMismatch when the file
    is another rank's or was built for another world size."""
    found = find_tp(metadata)
    if found is None:
        raise ArtifactError(f"{path} holds no tensor-parallel plans ({TP_KEY})")
    doc = found[1]
    rank, world = rank_and_world()
    archive = Path(params) if params is not None else Path(path).with_suffix(".irpa")
    saved = _saved_rank(doc, target, path, params, archive)
    if int(doc["world"]) != world or int(saved["world"]) != world:
        raise RankMismatch(
            f"{path} was compiled for a world of {doc['world']} ranks ({archive}: rank {saved['rank']} of "
            f"{saved['world']}); this one has {world}. Fix: launch {doc['world']} ranks (torchrun --nproc-per-node "
            f"{doc['world']}), or compile and save the model again split over {world}"
        )
    if int(saved["rank"]) != rank:
        raise RankMismatch(
            f"{path} is rank {saved['rank']}'s module ({archive} holds its shard of the weights), loaded on rank "
            f"{rank}. Fix: each rank loads its own file, e.g. fx_rewrites.load(f'model.rank{{rank}}.vmfb') with "
            "rank = torch.distributed.get_rank()"
        )
    plans = {public: Plan.from_json(entry["plan"]) for public, entry in doc["functions"].items()}
    _check_groups(plans, path)
    names = [_segment_name(public, name) for public, plan in plans.items() for name in plan.functions]
    module = target.load_file(path, names, params=params, driver=driver)
    return _assemble(doc, module, rank)


def _saved_rank(doc: Mapping[str, Any], target: Any, path: Any, params: Any, archive: Path) -> dict[str, Any]:
    """The rank and world size a rank's files were saved by: from its archive's record (a file written before
    the record moved there carries them in the module's metadata)."""
    if "rank" in doc:
        return {"rank": doc["rank"], "world": doc["world"]}
    text = target.read_record(path, RANK_KEY, params=params)
    if text is None:
        raise RankMismatch(
            f"{path} is a rank's module, and {archive} (its weights) holds no record of the rank it belongs to "
            f"({RANK_KEY}{'' if archive.is_file() else ': there is no such file'}). Fix: load it with the archive it "
            "was saved with (params='model.rank{rank}.irpa'), or save the rank's module again"
        )
    return json.loads(text)


__all__ = [
    "PREFIX",
    "RANK_KEY",
    "TP_KEY",
    "RankMismatch",
    "SegmentedFunction",
    "SegmentedModule",
    "collectives",
    "compile_segmented",
    "export_local",
    "find_tp",
    "is_tensor_parallel",
    "load_segmented",
    "local_program",
    "rank_and_world",
]
