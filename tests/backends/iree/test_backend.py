"""The IREE backend (llvm-cpu, local-task) on real exports, compared with eager.

CI installs iree (`.[iree]`): these tests do not skip without it. Each
compile of a tiny model takes about a second.
"""

from __future__ import annotations

import re
import sys

import attrs
import pytest
import torch
from torch.utils import _pytree as pytree

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.backends.iree import (
    CompileCache,
    IreeBackend,
    IreeCompileError,
    IreeImportError,
    IreeUnsupportedError,
    legality_data,
)
from fx_rewrites.engine import RewriteError
from fx_rewrites.rules import DEFAULT
from tests.backends.models import MLP, PoolNet


@pytest.fixture
def iree() -> IreeBackend:
    """A backend with its own (empty) cache, so every test compiles."""
    return IreeBackend(cache=CompileCache())


def _export(module: torch.nn.Module, *args, **kwargs) -> torch.export.ExportedProgram:
    return torch.export.export(module.eval(), args, kwargs or None)


def _assert_same(got, expected) -> None:
    """Same pytree structure, dtypes and (close) values."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    assert got_spec == exp_spec, f"structure {got_spec} != eager {exp_spec}"
    for g, e in zip(got_leaves, exp_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == e.dtype and g.shape == e.shape, (g, e)
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
        else:
            assert g == e


class Stats(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.argmax(-1), x > 0, x.sum(-1), x.double().cumsum(-1)


class Nested(torch.nn.Module):
    def forward(self, x: torch.Tensor, n: int, *, scale: torch.Tensor) -> dict:
        return {"scaled": x * scale, "pair": (x.max(-1).indices, (x * n) > 1), "none": None, "n": 3}


def test_registered():
    backend = backends.get("iree")
    assert isinstance(backend, IreeBackend) and backend.name == "iree"
    assert set(DEFAULT.names()) <= set(backend.rules.names())


def test_mlp_matches_eager(iree):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(8, 16)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    fn = iree.compile(ep, (x,))
    for batch in (x, torch.randn(3, 16)):  # one compile, any batch
        _assert_same(fn(batch), model(batch))


@pytest.mark.parametrize("rewritten", [False, True], ids=["as_is", "after_rules"])
def test_conv_net_with_functional_pooling(iree, rewritten):
    torch.manual_seed(0)
    model, x = PoolNet().eval(), torch.randn(2, 3, 16, 16)
    ep = _export(model, x)
    if rewritten:
        result = fx_rewrites.apply(ep, iree.rules)
        assert result.report.rewrites.get("pool_stride_defaults") == 2
        ep = result.program
    _assert_same(iree.compile(ep, (x,))(x), model(x))


def test_int64_bool_and_float64_outputs(iree):
    x = torch.randn(4, 5)
    got = iree.compile(_export(Stats(), x), (x,))(x)
    assert [t.dtype for t in got] == [torch.int64, torch.bool, torch.float32, torch.float64]
    _assert_same(got, Stats()(x))


def test_nested_outputs_kwargs_and_constants(iree):
    x, scale = torch.randn(3, 4), torch.randn(4)
    fn = iree.compile(_export(Nested(), x, 2, scale=scale), (x, 2))
    _assert_same(fn(x, 2, scale=scale), Nested()(x, 2, scale=scale))
    with pytest.raises(TypeError, match="takes"):
        fn(x, 2)  # scale missing


def test_user_input_mutation_is_written_back(iree):
    class AddInPlace(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.add_(1)
            return x * 2

    ep = _export(AddInPlace(), torch.randn(3)).run_decompositions()
    x = torch.randn(3)
    before = x.clone()
    out = iree.compile(ep, (x,))(x)
    torch.testing.assert_close(x, before + 1)
    torch.testing.assert_close(out, (before + 1) * 2)


def test_cache_hits_in_memory_then_on_disk(iree, tmp_path, monkeypatch):
    monkeypatch.setenv("FX_REWRITES_IREE_CACHE", str(tmp_path))
    x = torch.randn(2, 3)
    ep = _export(Stats(), x)
    first = iree.compile(ep, (x,))
    second = iree.compile(ep, (x,))
    assert (first.from_cache, second.from_cache) == (False, True)
    assert (iree.cache.misses, iree.cache.hits, iree.cache.disk_hits) == (1, 1, 0)
    assert first.key == second.key and (tmp_path / f"{first.key}.vmfb").is_file()

    fresh = IreeBackend(cache=CompileCache())  # a new process, in effect
    third = fresh.compile(ep, (x,))
    assert third.from_cache and (fresh.cache.misses, fresh.cache.disk_hits) == (0, 1)
    _assert_same(third(x), Stats()(x))


class Diff(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.diff(x)  # aten.diff: no IREE lowering (torch.operator)


class IsFinite(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.isfinite()  # a torch-dialect op IREE cannot convert


class AddInPlace(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1) * 2  # export keeps add_ (no mutation spec): not functional


@pytest.mark.parametrize(
    ("model", "op", "node", "hint", "record"),
    [
        (Diff(), "aten.diff", "diff", "no IREE lowering", r"`aten\.diff\.default` \(iree\.legality\): failed \d+x\."),
        (
            IsFinite(),
            "aten.isfinite",
            "isfinite",
            "no IREE lowering",
            r"`aten\.isfinite\.default` \(iree\.legality\): failed \d+x\.",
        ),
        (AddInPlace(), "aten.add_.Tensor", "add_", "in-place", None),  # the corpus measures no in-place op
    ],
    ids=["unknown_op", "no_conversion", "in_place"],
)
def test_compile_error_names_op_node_and_fix(iree, model, op, node, hint, record):
    ep = _export(model, torch.randn(3, 6))
    with pytest.raises(IreeCompileError) as info:
        iree.compile(ep, (torch.randn(3, 6),))
    e = info.value
    message = str(e)
    assert isinstance(e, RewriteError)
    assert f"`{op}` (node {node!r})" in message and hint in message and "rewrites.apply" in message
    assert "\n" not in message and "See diagnostics" not in message
    assert e.op == op and e.node == node
    assert "error:" in e.diagnostics and "main" in e.mlir
    assert __file__ in message  # the location is the model's source line
    # the op's measured record, counts only (no other sample's raw error text), or nothing when there is none
    if record is None:
        assert "measured record" not in message
    else:
        version = re.escape(legality_data.IREE_VERSION)
        assert re.search(rf"IREE {version}'s measured record for " + record, message), message
        assert "explicitly marked illegal" not in message.split("measured record")[1]


def test_compile_error_inside_iree_names_the_torch_node(iree):
    class MaskIndex(torch.nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x[mask]  # aten.index.Tensor with a bool mask: fails in IREE's own lowering (arith.cmpi)

    args = (torch.randn(6, 3), torch.tensor([True, False, True, True, False, True]))
    with pytest.raises(IreeCompileError, match=r"node 'index' \(`aten\.index\.Tensor`; it failed as `arith\.") as info:
        iree.compile(_export(MaskIndex(), *args), args)
    assert info.value.node == "index" and "\n" not in str(info.value)


def test_import_error_names_the_node():
    class Cond(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cond(x.sum() > 0, lambda x: x + 1, lambda x: x - 1, (x,))

    ep = _export(Cond(), torch.randn(3))
    with pytest.raises(IreeImportError, match=r"node 'cond' \(cond\).*not implemented.*rewrites\.apply") as info:
        IreeBackend().compile(ep, (torch.randn(3),))
    assert info.value.node == "cond" and isinstance(info.value.cause, NotImplementedError)
    assert any(n.name == "cond" for n in ep.graph.nodes)  # the importer worked on a copy


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))
        self.register_buffer("last", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        self.last.copy_(x)
        return x * self.count


@pytest.mark.parametrize("state", ["module", "host"])
def test_mutated_buffers_keep_their_state_like_eager(iree, state):
    """state="module" (the default): the state lives in the module's mutable globals, and the program's
    tensors stay as they were; state="host": it is read and written at each call in the program's
    state_dict/constants (as program.module() does)."""
    reference, model = Counter(), Counter()
    x = torch.randn(2)
    ep = fx_rewrites.apply(_export(model, x)).program  # the in-place rules write BUFFER_MUTATION outputs
    assert sorted(ep.graph_signature.buffers_to_mutate.values()) == ["count", "last"]
    fn = attrs.evolve(iree, state=state).compile(ep, (x,))
    assert ("util.global private mutable @__state_count" in fn.mlir) == (state == "module")
    for _ in range(3):
        x = torch.randn(2)
        _assert_same(fn(x), reference(x))
    if state == "host":
        assert ep.state_dict["count"].item() == 3 and torch.equal(ep.constants["last"], x)
        assert model.count.item() == 3  # shared with the module, as program.module() does
    else:
        assert ep.state_dict["count"].item() == 0 and not ep.constants["last"].any()
        assert model.count.item() == 0


def test_graph_module_input_says_export_first():
    gm = torch.fx.symbolic_trace(MLP())
    with pytest.raises(NotImplementedError, match=r"ExportedProgram.*torch\.export\.export") as info:
        IreeBackend().compile(gm, (torch.randn(2, 16),))
    assert isinstance(info.value, IreeUnsupportedError)


def test_missing_iree_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "iree.runtime", None)  # as if iree-base-runtime were absent
    ep = _export(MLP(), torch.randn(2, 16))
    with pytest.raises(ImportError, match=r"pip install -e '\.\[iree\]'"):
        IreeBackend().compile(ep, (torch.randn(2, 16),))


class DiffAndWeightNorm(torch.nn.Module):
    """aten.diff (transformers mask code) and aten._weight_norm (wav2vec2)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(2, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.diff(self.conv(x), dim=-1)


def test_iree_rules_make_diff_and_weight_norm_compile(iree):
    from fx_rewrites import testing as rt
    from fx_rewrites.backends.iree.rules.ops import decompose_for_iree

    torch.manual_seed(0)
    model = DiffAndWeightNorm().eval()
    x = torch.randn(1, 2, 9)
    ep = _export(model, x)
    assert {torch.ops.aten.diff.default, torch.ops.aten._weight_norm.default} <= set(rt.targets(ep))
    with pytest.raises(IreeCompileError, match=r"aten\.(diff|_weight_norm)"):
        iree.compile(ep, (x,))
    result = fx_rewrites.apply(ep, iree.rules)
    rt.assert_fired(result, decompose_for_iree, times=3)  # _weight_norm -> _weight_norm_interface -> ops
    with torch.no_grad():
        _assert_same(iree.compile(result.program, (x,))(x), model(x))


class NonPersistentBuffer(torch.nn.Module):
    """Like BERT's position_ids: a buffer kept out of the state dict."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("positions", torch.arange(6).float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.positions


def test_non_persistent_buffer(iree):
    x = torch.randn(2, 6)
    model = NonPersistentBuffer()
    ep = _export(model, x)
    assert "positions" in ep.constants and "positions" not in ep.state_dict
    _assert_same(iree.compile(ep, (x,))(x), model(x))


# -- GraphModules: the forward graph an aot_autograd backend of torch.compile receives ----------


def _aot_forward(fn, *args, dynamic: bool) -> torch.fx.GraphModule:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=aot_autograd(fw_compiler=capture), dynamic=dynamic)(*args)
    torch._dynamo.reset()
    (gm,) = graphs
    return gm


def test_aot_graph_module_takes_its_placeholders(iree):
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(5, 16)
    gm = _aot_forward(model, x, dynamic=False)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fn = iree.compile(gm, ())
    # parameters are inputs of this graph (dynamo lifts them), in the order the graph reads them
    by_shape = {tuple(t.shape): t for t in (x, *model.parameters())}  # the shapes differ
    args = [by_shape[tuple(n.meta["val"].shape)] for n in placeholders]
    assert len(args) == 5
    _assert_same(fn(*args), (model(x),))
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == [n.name for n in placeholders]  # untouched


def test_aot_graph_module_recomputes_symint_sizes(iree):
    fn = lambda x: torch.relu(x) * x.shape[0] + x.shape[1]
    gm = _aot_forward(fn, torch.randn(4, 3), dynamic=True)
    kinds = [type(n.meta["val"]).__name__ for n in gm.graph.nodes if n.op == "placeholder"]
    assert kinds == ["SymInt", "SymInt", "FakeTensor"]  # dynamo puts the sizes first
    for graph in (gm, fx_rewrites.apply(gm, iree.rules).graph_module):  # as is, and after the rules
        compiled = iree.compile(graph, ())
        signature = next(line for line in compiled.mlir.splitlines() if "func.func @main" in line)
        assert "!torch.int" not in signature.split("->")[0]  # IREE gets the tensor only
        for rows in (4, 7):
            x = torch.randn(rows, 3)
            _assert_same(compiled(rows, 3, x), (fn(x),))
            _assert_same(compiled(999, -1, x), (fn(x),))  # the sizes are read off x, not taken from the caller
