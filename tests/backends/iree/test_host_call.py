"""A call on a CPU device takes `host_call.HostCall`: torch tensors in and out, inputs imported where the plan says
they are only read, fresh results handed out over IREE's buffer. These tests check what it gives against eager, which
inputs it imports, that the input check sees a write through it, the conversion of a result of another element type,
and that a result held to the interpreter's exit ends the process cleanly (CPU devices are kept for the process).
Small compiles."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import attrs
import pytest
import torch
from torch.export import Dim

from fx_rewrites import apply, backends
from fx_rewrites.backends.iree import IreeBackend
from fx_rewrites.backends.iree.calling import CHECK_ENV, InputWrittenError
from fx_rewrites.backends.iree.host_call import HostCall, _overlaps

RTOL, ATOL = 1e-5, 1e-6  # a 16-channel 1x1 convolution: torch's own float32 error is ~2.4e-7 abs (against float64)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Pointwise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Accumulated(torch.nn.Module):
    def forward(self, x: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return torch.index_put(x, (rows,), values, accumulate=True)


class Signs(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x > 0, torch.tanh(x)


def _compiled(model: torch.nn.Module, args: tuple, dynamic_shapes: Any = None, driver: str = "local-sync") -> Any:
    exported = torch.export.export(model, args, dynamic_shapes=dynamic_shapes)
    program = apply(exported, backends.get("iree").rules).program
    return IreeBackend(driver=driver).compile(program, args)


class _CountingAllocator:
    """An allocator counting imports and copies (HostCall's `_allocator` replaced by it)."""

    def __init__(self, allocator: Any) -> None:
        self.allocator, self.imports, self.copies = allocator, 0, 0

    def import_host_allocation(self, *args: Any) -> Any:
        self.imports += 1
        return self.allocator.import_host_allocation(*args)

    def allocate_buffer_copy(self, *args: Any) -> Any:
        self.copies += 1
        return self.allocator.allocate_buffer_copy(*args)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
@pytest.mark.parametrize("driver", ["local-sync", "local-task"])
def test_a_cpu_call_imports_its_input_and_hands_out_its_result(driver, dynamic):
    model = Pointwise().eval()
    example = (torch.randn(2, 16, 6, 6, generator=_g(1)),)
    shapes = ({0: Dim("n", min=1, max=8)},) if dynamic else None
    compiled = _compiled(model, example, shapes, driver)
    assert compiled.plan.unwritten == (True,) and compiled.plan.fresh == (True,)
    compiled(example[0])
    host = compiled._fast
    assert isinstance(host, HostCall)
    host._allocator = counting = _CountingAllocator(host._allocator)
    for seed, n in ((2, 2), (3, 5 if dynamic else 2)):
        x = torch.randn(n, 16, 6, 6, generator=_g(seed))
        kept = x.clone()
        got = compiled(x)
        with torch.no_grad():
            want = model(kept)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        assert got._base is not None  # a view of the tensor over IREE's buffer: handed out, not cloned
        torch.testing.assert_close(x, kept, rtol=0, atol=0)
    assert (counting.imports, counting.copies) == (2, 0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_graph_module_of_static_inputs_takes_the_host_path_and_checks_them(dynamic):
    """The torch.compile route compiles GraphModules: their static tensor placeholders are the plan's inputs, so a
    call takes HostCall (it took iree.runtime's invoker, ~0.3 ms more on a 64 x 112 x 112 max pool), and an input of
    another shape is refused by name. A symbolic size leaves the plan's inputs empty (the general path)."""
    from fx_rewrites.backends.dynamo import CompiledGraph, dynamo_backend

    graphs: list[CompiledGraph] = []
    torch._dynamo.reset()
    try:
        backend = dynamo_backend(IreeBackend(driver="local-sync"), strict=True, on_graph=graphs.append)
        compiled = torch.compile(lambda x: torch.tanh(x) * 2, backend=backend, dynamic=dynamic)
        x = torch.randn(2, 16, 6, 6, generator=_g(11))
        torch.testing.assert_close(compiled(x), torch.tanh(x) * 2, rtol=RTOL, atol=ATOL)
    finally:
        torch._dynamo.reset()
    (graph,) = graphs
    module = graph.compiled
    if dynamic:
        assert module.plan.inputs == ()
        return
    assert [(i.kind, i.dtype, i.shape) for i in module.plan.inputs] == [("tensor", torch.float32, (2, 16, 6, 6))]
    out = module(x)
    got = out[0] if isinstance(out, (tuple, list)) else out  # aot's graphs return tuples
    assert isinstance(module._fast, HostCall)
    torch.testing.assert_close(got, torch.tanh(x) * 2, rtol=RTOL, atol=ATOL)
    with pytest.raises(Exception, match=r"2, 16, 6, 6"):
        module(torch.randn(3, 16, 6, 6))


def test_inputs_it_cannot_import_are_copied_with_the_same_results():
    model = Pointwise().eval()
    example = (torch.randn(1, 16, 6, 6, generator=_g(4)),)
    compiled = _compiled(model, example)
    compiled(example[0])
    compiled._fast._allocator = counting = _CountingAllocator(compiled._fast._allocator)
    flat = torch.randn(16 * 36 + 1, generator=_g(5))
    inputs = {
        "misaligned": flat[1:].view(1, 16, 6, 6),
        "not contiguous": torch.randn(1, 6, 6, 16, generator=_g(6)).permute(0, 3, 1, 2),
        # outside no_grad, Tensor.numpy() refuses it: host_array's detached copy
        "requires grad": torch.randn(1, 16, 6, 6, generator=_g(7)).requires_grad_(),
    }
    for name, x in inputs.items():
        before = counting.copies
        got = compiled(x)
        with torch.no_grad():
            want = model(x.detach().clone())
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=name)
        assert counting.copies == before + 1, name
    assert counting.imports == 0


def test_the_check_catches_a_write_through_the_host_path(monkeypatch):
    """The index_put's x forced unwritten: IREE writes the caller's x in place and the check says so."""
    monkeypatch.setenv(CHECK_ENV, "1")
    args = (torch.zeros(4, 5), torch.tensor([0, 2, 2]), torch.ones(3, 5))
    compiled = _compiled(Accumulated(), args)
    forced = HostCall.of(attrs.evolve(compiled.plan, unwritten=(True, True, True)), compiled.function)
    assert forced is not None
    with pytest.raises(InputWrittenError, match="wrote into its argument 0"):
        forced(args)


def test_a_result_of_another_element_type_is_converted_to_the_plans():
    x = torch.randn(3, 4, generator=_g(8))
    compiled = _compiled(Signs(), (x,))
    signs, tanh = compiled(x)
    assert signs.dtype == torch.bool and torch.equal(signs, x > 0)
    torch.testing.assert_close(tanh, torch.tanh(x), rtol=1e-6, atol=1e-6)
    # the plan promising float64 for the float32 tanh: the element types differ, so the result is converted
    outputs = (compiled.plan.outputs[0], attrs.evolve(compiled.plan.outputs[1], dtype=torch.float64))
    host = HostCall.of(attrs.evolve(compiled.plan, outputs=outputs), compiled.function)
    signs, tanh = host((x,))
    assert tanh.dtype == torch.float64 and torch.equal(signs, x > 0)
    torch.testing.assert_close(tanh, torch.tanh(x).double(), rtol=1e-6, atol=1e-6)


class Products(torch.nn.Module):
    """addmv and addr (test_legalize's form): IREE returns addmv's [n] in a 64-byte buffer."""

    def forward(self, x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = v[: x.shape[1]]
        return torch.addmv(v, x, w), torch.addr(x, v, w)


@pytest.mark.parametrize("n", [6, 7])
def test_a_result_in_a_larger_buffer_is_read_at_its_own_size(n):
    """The mapping spans IREE's whole buffer (64 bytes for 6 floats): the tensor is the view's n floats."""
    example = (torch.randn(6, 5, generator=_g(9)), torch.randn(6, generator=_g(10)))
    compiled = _compiled(Products(), example, ({0: Dim("n", min=6)}, {0: Dim("n", min=6)}))
    args = (torch.randn(n, 5, generator=_g(11 + n)), torch.randn(n, generator=_g(12 + n)))
    got = compiled(*args)
    assert [tuple(g.shape) for g in got] == [(n,), (n, 5)]
    for g, w in zip(got, Products()(*args), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_overlaps_compares_byte_spans():
    base = torch.zeros(16)
    assert _overlaps(base[4:8], [base[6:10]])
    assert not _overlaps(base[4:8], [base[8:12], torch.zeros(4)])


def test_a_result_held_to_the_end_of_the_process_ends_it_cleanly(tmp_path):
    """A handed-out result in a global outlives the runtime's modules at shutdown: the process ends with no crash
    and no nanobind report (the CPU device is kept for the process)."""
    script = textwrap.dedent(
        """
        import torch, fx_rewrites
        from fx_rewrites.backends.iree import IreeBackend

        model = torch.nn.Conv2d(8, 4, 1).eval()
        x = torch.randn(1, 8, 5, 5)
        program = fx_rewrites.apply(torch.export.export(model, (x,)), IreeBackend().rules).program
        KEPT = IreeBackend().compile(program, (x,))(x)
        with torch.no_grad():
            print("close", torch.allclose(KEPT, model(x), rtol=1e-5, atol=1e-6), KEPT._base is not None)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0 and "close True True" in proc.stdout, proc.stderr[-3000:]
    assert "nanobind" not in proc.stderr, proc.stderr[-3000:]
