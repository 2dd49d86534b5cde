"""Cutting a rank's program at its collectives (backends/segments.py, backends/collectives.py), on real exports.

The programs here call the functional collectives on a one-rank gloo group made in this process (an all_reduce
over one rank returns its input), so the cut program's numbers can be checked against eager quickly; the
multi-rank runs are in test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.export import Dim

import fx_rewrites
from fx_rewrites.backends import collectives, segments
from fx_rewrites.backends.collectives import HostCall, UnhandledCollective
from fx_rewrites.backends.segments import DeviceStep, HostStep, Plan
from tests.distributed.launch import free_port
from tests.distributed.ranks import InPlaceAllReduce

F = torch.ops._c10d_functional


class RowParallel(torch.nn.Module):
    """A row-parallel linear's form: local matmul, all_reduce + wait, then element-wise work, and a counter
    buffer updated in place (state a segment keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.wait_tensor(F.all_reduce(x @ self.w, "sum", "0"))
        self.calls.add_(1)
        z = F.wait_tensor(F.all_gather_into_tensor(torch.relu(y), 1, "0"))
        return z * self.calls + x.shape[0]


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group named "0" (what the programs name), removed after this module's tests."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _export(dynamic: bool) -> torch.export.ExportedProgram:
    shapes = ({0: Dim("rows", min=2, max=64)},) if dynamic else None
    return torch.export.export(RowParallel(), (torch.randn(4, 8),), dynamic_shapes=shapes)


def test_plan_of_a_row_parallel_linear():
    program = fx_rewrites.apply(_export(dynamic=False)).program
    plan, programs = segments.segment_program(program)
    kinds = [type(s).__name__ for s in plan.steps]
    assert kinds == ["DeviceStep", "HostStep", "DeviceStep", "HostStep", "DeviceStep"]
    assert plan.collectives == 2 and plan.host_round_trips == 2  # each collective and its wait: one host step
    host = [c.op for s in plan.steps if isinstance(s, HostStep) for c in s.calls]
    assert host == [
        "_c10d_functional.all_reduce.default",
        "_c10d_functional.wait_tensor.default",
        "_c10d_functional.all_gather_into_tensor.default",
        "_c10d_functional.wait_tensor.default",
    ]
    first = programs[plan.functions[0]].graph_signature
    assert [s.target for s in first.input_specs if s.target] == ["w", "calls"]  # the state the segment reads
    writes = [s.target for p in programs.values() for s in p.graph_signature.output_specs if s.target]
    assert writes == ["calls"]  # written once, by the segment computing its new value
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_segments_on_iree_match_eager(group, dynamic):
    torch.manual_seed(1)
    module = RowParallel()
    program = _export(dynamic)
    compiled = fx_rewrites.compile(program)
    assert len(compiled.runtime.functions["main"].run.plan.functions) == 3
    sizes = [4, 4] if not dynamic else [4, 9]
    for rows in sizes:  # the counter advances in both, call after call
        x = torch.randn(rows, 8)
        torch.testing.assert_close(compiled(x), module(x), rtol=1e-5, atol=1e-5)


def test_a_size_read_across_segments_is_recomputed_in_each():
    program = fx_rewrites.apply(_export(dynamic=True)).program
    plan, programs = segments.segment_program(program)
    for name, segment in programs.items():  # no segment returns a size or takes one as an input
        for node in segment.graph.nodes:
            if node.op in ("placeholder", "output"):
                values = node.meta.get("val") if node.op == "placeholder" else node.args[0]
                assert not isinstance(values, torch.SymInt), (name, node)
    last = programs[plan.functions[-1]]
    sizes = [n for n in last.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    assert sizes and all(n.args[0].op == "placeholder" for n in sizes)  # `x.shape[0]` read off x again
    step = next(s for s in plan.steps if isinstance(s, DeviceStep) and s.function == plan.functions[-1])
    assert 0 in step.inputs  # x, the program's input, whose rows the last segment adds


def test_unhandled_collective_is_named():
    program = torch.export.export(InPlaceAllReduce(), (torch.ones(2, 3),))
    with pytest.raises(
        UnhandledCollective, match=r"`_c10d_functional\.all_reduce_\.default`.*writes into its argument"
    ) as e:
        collectives.check(program.graph_module)
    assert e.value.op == "_c10d_functional.all_reduce_.default"


def test_a_saved_host_step_runs_only_collectives():
    with pytest.raises(UnhandledCollective, match=r"aten\.add\.Tensor.*not among the collectives"):
        HostCall.from_json({"op": "aten.add.Tensor", "args": [{"slot": 0}, 1], "out": 1})
