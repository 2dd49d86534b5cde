"""torch.compile(backend=fx_rewrites_iree / fx_rewrites_eager): aot_autograd graphs, rewritten, on IREE.

Every graph dynamo makes goes through `fx_rewrites.apply(graph, backend.rules)`
and `IreeBackend.compile`; the `on_graph` hook records each one, so the
tests see what the rules did. IREE compiles each graph in about a second.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed
from torch.utils import _pytree as pytree

from fx_rewrites import backends
from fx_rewrites.backends.dynamo import (
    BackwardNotSupported,
    CompiledGraph,
    EagerFallbackWarning,
    dynamo_backend,
    fx_rewrites_eager,
    fx_rewrites_iree,
)
from fx_rewrites.backends.iree import IreeCompiled
from fx_rewrites.ruleset import RuleSet
from tests.backends.models import MLP, PoolNet


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def iree_graphs() -> tuple:
    """A fx_rewrites_iree-like backend that records every graph it compiles."""
    graphs: list[CompiledGraph] = []
    return dynamo_backend("iree", on_graph=graphs.append), graphs


def _assert_close(got, expected) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    exp_leaves, exp_spec = pytree.tree_flatten(expected)
    assert got_spec == exp_spec, f"structure {got_spec} != eager {exp_spec}"
    for g, e in zip(got_leaves, exp_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            assert g.dtype == e.dtype and g.shape == e.shape, (g, e)
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
        else:
            assert g == e


def _scalar_args(compiled: IreeCompiled) -> list[str]:
    """The func arguments IREE gets as scalars (`!torch.int` / `!torch.float`)."""
    signature = next(line for line in compiled.mlir.splitlines() if "func.func @main" in line)
    return [t for t in ("!torch.int", "!torch.float") if t in signature.split("->")[0]]


def _has_sym_placeholder(graph: CompiledGraph) -> bool:
    return any(
        isinstance(n.meta.get("val"), torch.SymInt) for n in graph.graph_module.graph.nodes if n.op == "placeholder"
    )


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize(
    ("make", "shapes", "fired"),
    [
        (MLP, [(3, 16), (5, 16)], {}),
        (PoolNet, [(2, 3, 16, 16), (3, 3, 12, 12)], {"pool_stride_defaults": 2}),
    ],
    ids=["mlp", "conv_pool"],
)
def test_models_match_eager(iree_graphs, make, shapes, fired, dynamic):
    backend, graphs = iree_graphs
    torch.manual_seed(0)
    model = make().eval()
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    shapes = shapes if dynamic else shapes[:1]  # static: one shape, one graph (a new shape recompiles)
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(shape)
            _assert_close(compiled(x), model(x))
    (graph,) = graphs  # dynamic: one compile serves both shapes
    assert graph.kind == "inference" and graph.backend == "iree" and isinstance(graph.compiled, IreeCompiled)
    assert {k: graph.result.report.rewrites[k] for k in fired} == fired
    # dynamic=True: dynamo passes SymInt sizes; IREE never gets them, it reads the sizes off the tensors
    assert _has_sym_placeholder(graph) == dynamic
    assert _scalar_args(graph.compiled) == []


class Gates(torch.nn.Module):
    """What the aot graph needs rules for: a bool-mask assignment (index_put with a bool
    index, a lifted constant), torch.cond on a tensor predicate, functional max_pool1d;
    with dynamic=True the batch size in a Tensor slot. no_grad in forward is inlined
    by aot_autograd (nothing to rewrite)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x).clone()
        y[y < 0] = 0.5
        with torch.no_grad():
            z = y * 2
        w = torch.cond(z.sum() > 4, lambda t: t.sin(), lambda t: t.cos(), (z,))
        return w * x.shape[0] + F.max_pool1d(x.unsqueeze(1), 2).squeeze(1).sum(-1, keepdim=True)


def test_rules_fire_on_the_aot_graph(iree_graphs):
    backend, graphs = iree_graphs
    torch.manual_seed(0)
    model = Gates().eval()
    with torch.no_grad(), pytest.raises(BackendCompilerFailed, match=r"IreeImportError.*node 'cond'"):
        as_is = dynamo_backend("iree", rules=RuleSet([]), strict=True)  # strict: raises, not eager
        torch.compile(model, backend=as_is, dynamic=True, fullgraph=True)(torch.randn(3, 8))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for x in (torch.randn(3, 8), -torch.randn(3, 8).abs() - 2, torch.randn(5, 8)):  # both cond branches
            _assert_close(compiled(x), model(x))
    (graph,) = graphs
    assert dict(graph.result.report.rewrites) == {
        "mask_index_put_to_where": 1,
        "cond_to_where": 1,
        "lift_fresh_copy_to_clone": 1,  # the 0.5 of the masked assignment
        "pool_stride_defaults": 1,
        "max_pool_without_unread_indices": 1,  # aot's max_pool1d_with_indices(...)[0] (an llvm-cpu ISA's rule)
        "sym_scalar_in_tensor_slot": 1,  # mul.Tensor(w, <SymInt placeholder>) -> mul.Scalar
        "float_scalar_in_comparison_for_iree": 2,  # x > 0 of a float x compares with 0.0 (findings section 15)
        "float32_trig_via_float64_for_iree": 2,  # the branches' sin and cos, computed in float64
        "float64_sin_written_out_for_iree": 1,  # ... in float64 forms written out (no libm call)
        "float64_cos_written_out_for_iree": 1,
    }
    assert graph.result.report.converged
    targets = {n.target for n in graph.result.graph_module.graph.nodes}
    assert torch.ops.higher_order.cond not in targets and torch.ops.aten.index_put.default not in targets


def test_item_value_is_a_scalar_argument(iree_graphs):
    # x * n.item() breaks the graph; the second graph gets the value as a SymInt input that is
    # no tensor's size: IREE gets it as a scalar (!torch.int), in a Scalar slot (mul.Scalar)
    backend, graphs = iree_graphs
    fn = lambda x, n: x * n.item() + 1
    compiled = torch.compile(fn, backend=backend, dynamic=True)
    for k in (2, 3, -4):
        x, n = torch.randn(4, 3), torch.tensor(k)
        _assert_close(compiled(x, n), fn(x, n))
    (graph,) = graphs
    assert graph.result.report.rewrites["sym_scalar_in_tensor_slot"] == 1
    assert _scalar_args(graph.compiled) == ["!torch.int"]


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        x.mul_(2)
        return x * self.count


def test_mutations_are_written_back(iree_graphs):
    backend, graphs = iree_graphs
    model, reference = Counter(), Counter()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3)
            x_ref = x.clone()
            _assert_close(compiled(x), reference(x_ref))
            torch.testing.assert_close(x, x_ref)
    assert model.count.item() == 3 and len(graphs) == 1


# -- freezing: parameters and buffers compiled in as constants (backends/freezing.py) -----------


def _main_arguments(compiled: IreeCompiled) -> list[str]:
    """The tensor types of the arguments of the compiled module's `main`."""
    signature = next(line for line in compiled.mlir.splitlines() if "func.func @main" in line)
    return re.findall(r"%arg\d+: (!torch\.\w+<[^>]*>)", signature.split("->")[0])


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, groups=4)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv1(x)))
        return self.fc(self.conv2(y).mean((2, 3)))


def _state_count(model: torch.nn.Module) -> int:
    return len(list(model.parameters())) + len([b for name, b in model.named_buffers() if "num_batches" not in name])


@pytest.mark.parametrize("make", [MLP, ConvNet], ids=["mlp", "conv"])
def test_inference_graphs_freeze_their_weights(make):
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = make().eval()
    x_shape = (3, 16) if make is MLP else (2, 3, 12, 12)
    compiled = torch.compile(model, backend=dynamo_backend("iree", on_graph=graphs.append))
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(x_shape)
            _assert_close(compiled(x), model(x))
    (graph,) = graphs
    # every parameter and buffer the graph reads is a constant: main takes the input only
    assert graph.kind == "inference" and len(graph.frozen) == _state_count(model)
    assert _main_arguments(graph.compiled) == [f"!torch.vtensor<[{','.join(map(str, x_shape))}],f32>"]
    assert "torch.vtensor.literal" in graph.compiled.mlir


class TableLookup(torch.nn.Module):
    """Swin's relative position bias: a table indexed by an index buffer (an item of aten.index's list)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(9, 2))
        self.register_buffer("index", torch.tensor([[0, 4, 8], [2, 4, 6]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[self.index].sum(-1)


def test_a_frozen_tensor_inside_a_list_argument_compiles():
    """A frozen buffer read as an index (inside aten.index's list) is imported through a clone: as a literal in
    the list the importer failed ('Heterogeneous lists are not supported', the zoo's swin)."""
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = TableLookup().eval()
    compiled = torch.compile(model, backend=dynamo_backend("iree", on_graph=graphs.append))
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3)
            _assert_close(compiled(x), model(x))
    (graph,) = graphs
    assert not graph.fallback and len(graph.frozen) == 2


@pytest.mark.parametrize("how", ["argument", "option", "env"])
def test_freezing_opt_out(how, monkeypatch):
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = ConvNet().eval()
    kwargs, options = {}, None
    if how == "argument":
        kwargs = {"freeze": False}
    elif how == "option":
        options = {"freeze": False}
    else:
        monkeypatch.setenv("FX_REWRITES_FREEZE", "0")
    backend = dynamo_backend("iree", on_graph=graphs.append, **kwargs)
    compiled = torch.compile(model, backend=backend, options=options)
    with torch.no_grad():
        x = torch.randn(2, 3, 12, 12)
        _assert_close(compiled(x), model(x))
    (graph,) = graphs
    assert graph.frozen == () and len(_main_arguments(graph.compiled)) == 1 + _state_count(model)


def test_grad_enabled_graph_is_not_frozen():
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = ConvNet().train()
    compiled = torch.compile(model, backend=dynamo_backend("iree", on_graph=graphs.append))
    x = torch.randn(2, 3, 12, 12)
    reference = ConvNet().train()
    reference.load_state_dict(model.state_dict())
    _assert_close(compiled(x), reference(x))  # train mode: BatchNorm's running stats are updated in the graph
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)
    (graph,) = graphs
    assert graph.kind == "forward" and graph.frozen == ()
    assert len(_main_arguments(graph.compiled)) > 1 + len(list(model.parameters()))
    with pytest.warns(UserWarning, match=r"backward graph runs on torch eager"):
        compiled(x).sum().backward()
    assert model.fc.weight.grad is not None


class RunningScale(torch.nn.Module):
    """A buffer updated in forward (it must stay an input) beside a parameter (frozen)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.sum(0))
        return self.fc(x) + self.total


def test_buffer_updated_in_forward_stays_an_input():
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model, reference = RunningScale(), RunningScale()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=dynamo_backend("iree", on_graph=graphs.append))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4)
            _assert_close(compiled(x), reference(x))
    torch.testing.assert_close(model.total, reference.total)
    (graph,) = graphs
    assert len(graph.frozen) == 2 and not any("total" in name for name in graph.frozen)
    assert _main_arguments(graph.compiled) == ["!torch.vtensor<[4],f32>", "!torch.vtensor<[2,4],f32>"]


def test_changed_weights_compile_again():
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model, reference = MLP().eval(), MLP().eval()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=dynamo_backend("iree", on_graph=graphs.append))
    x = torch.randn(3, 16)
    with torch.no_grad():
        _assert_close(compiled(x), reference(x))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _assert_close(compiled(x), reference(x))  # unchanged: no second compile
        assert not [w for w in caught if "frozen" in str(w.message)]
        for change in (
            lambda m: m.fc1.weight.mul_(2),  # in place (load_state_dict, an optimizer step)
            lambda m: setattr(m.fc2, "bias", torch.nn.Parameter(torch.ones(4))),  # reassigned
        ):
            change(model), change(reference)
            with pytest.warns(UserWarning, match=r"frozen parameter.*changed.*compiling it again"):
                _assert_close(compiled(x), reference(x))
            _assert_close(compiled(x), reference(x))
    assert len(graphs) == 1  # dynamo did not recompile: the backend's Frozen did, twice


# -- graph breaks: Python pre- and post-processing around the model (seed 001 #2) ---------

WORDS = ("the", "a", "cat", "dog", "sat", "on", "mat", "ran", "fast", "slow")
VOCAB = {w: i + 2 for i, w in enumerate(WORDS)}  # 0 pads, 1 is unknown
LABELS = ("negative", "positive", "neutral")


class BagClassifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(len(VOCAB) + 2, 16, padding_idx=0)
        self.fc = torch.nn.Linear(16, len(LABELS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).unsqueeze(-1)
        return self.fc((self.emb(ids) * mask).sum(1) / mask.sum(1).clamp(min=1))


def pipeline(model: torch.nn.Module, texts: list[str]) -> list[dict]:
    """A 'pipeline': a Python tokenizer, the model, Python post-processing (`.tolist()` breaks the graph)."""
    ids = [[VOCAB.get(w, 1) for w in text.lower().split()] for text in texts]
    width = max(len(row) for row in ids)
    batch = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    scores, best = model(batch).softmax(-1).max(-1)
    return [
        {"text": text, "label": LABELS[b], "score": round(s, 4)}
        for text, b, s in zip(texts, best.tolist(), scores.tolist())
    ]


def test_pipeline_with_python_around_the_model(iree_graphs):
    backend, graphs = iree_graphs
    torch.manual_seed(0)
    model = BagClassifier().eval()
    compiled = torch.compile(pipeline, backend=backend)
    batches = [["The cat sat on the mat", "a dog ran"], ["slow dog", "fast cat ran", "the zebra"]]
    with torch.no_grad():
        for texts in batches:
            got, expected = compiled(model, texts), pipeline(model, texts)
            assert [(r["text"], r["label"]) for r in got] == [(r["text"], r["label"]) for r in expected]
            assert [r["score"] for r in got] == pytest.approx([r["score"] for r in expected], abs=1.5e-4)
    # the tokens are constants dynamo traced (it guards on the strings); the lists and
    # dicts were built by Python, each graph ran on IREE
    assert 1 <= len(graphs) <= len(batches)
    for graph in graphs:
        assert isinstance(graph.compiled, IreeCompiled)
        assert torch.ops.aten.embedding.default in {n.target for n in graph.result.graph_module.graph.nodes}


# -- transformers -------------------------------------------------------------------------


def test_tiny_bert(iree_graphs):
    transformers = pytest.importorskip("transformers")
    backend, graphs = iree_graphs
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()  # random weights, no download
    ids = torch.randint(0, 100, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask)
        expected = model(input_ids=ids, attention_mask=mask)
    for name in ("last_hidden_state", "pooler_output"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-4, atol=1e-4)
    assert len(graphs) == 1 and isinstance(graphs[0].compiled, IreeCompiled)


# -- a graph the backend cannot compile runs on eager --------------------------------------


def test_graph_the_backend_cannot_compile_runs_on_eager(monkeypatch):
    """Without its rules, Gates' cond does not import into IREE: the graph runs on torch eager, as aot_autograd
    gave it, with one warning (for two calls) that names the op, the error and how to raise instead."""
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = Gates().eval()
    monkeypatch.delenv("FX_REWRITES_STRICT")  # a user's default (tests/conftest.py sets it for every other test)
    compiled = torch.compile(model, backend=dynamo_backend("iree", rules=RuleSet([]), on_graph=graphs.append))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for x in (torch.randn(3, 8), -torch.randn(3, 8).abs() - 2):
                _assert_close(compiled(x), model(x))
    fallbacks = [w for w in caught if issubclass(w.category, EagerFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    text = str(fallbacks[0].message)
    assert "inference graph" in text and "runs on torch eager" in text
    assert "because `cond` stopped its compile: IreeImportError" in text, text
    assert "FX_REWRITES_STRICT=1" in text and "'strict': True" in text
    (graph,) = graphs
    assert graph.fallback == text and graph.compiled is graph.graph_module


@pytest.mark.parametrize("how", ["env", "option", "argument"])
def test_strict_mode_raises(how, monkeypatch):
    monkeypatch.setenv("FX_REWRITES_STRICT", "1" if how == "env" else "0")
    model = Gates().eval()
    options = None
    if how == "env":
        backend = dynamo_backend("iree", rules=RuleSet([]))
    elif how == "option":
        backend, options = dynamo_backend("iree", rules=RuleSet([])), {"strict": True}
    else:
        backend = dynamo_backend("iree", rules=RuleSet([]), strict=True)
    compiled = torch.compile(model, backend=backend, options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)
        with torch.no_grad(), pytest.raises(BackendCompilerFailed, match=r"IreeImportError.*node 'cond'"):
            compiled(torch.randn(3, 8))


def test_strict_off_overrides_the_environment(monkeypatch):
    """options={"strict": False} falls back even with FX_REWRITES_STRICT=1 (which tests/conftest.py sets)."""
    monkeypatch.setenv("FX_REWRITES_STRICT", "1")
    model = Gates().eval()
    compiled = torch.compile(model, backend=dynamo_backend("iree", rules=RuleSet([])), options={"strict": False})
    with pytest.warns(EagerFallbackWarning, match="cond"), torch.no_grad():
        x = torch.randn(3, 8)
        _assert_close(compiled(x), model(x))


# -- backward, the eager backend, the names ----------------------------------------------


def test_backward_runs_on_eager_with_a_warning(iree_graphs):
    backend, graphs = iree_graphs
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(3, 16, requires_grad=True)
    out = compiled(x)
    assert [g.kind for g in graphs] == ["forward"]  # grad enabled: the forward of a training graph, on IREE
    with pytest.warns(UserWarning, match=r"backward graph runs on torch eager"):
        out.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    model.zero_grad()
    model(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_backward_error_mode():
    model = MLP()
    compiled = torch.compile(model, backend=dynamo_backend("iree", backward="error"))
    out = compiled(torch.randn(3, 16))  # the forward runs
    with pytest.raises(BackwardNotSupported, match=r"torch\.no_grad\(\)"):
        out.sum().backward()
    with pytest.raises(ValueError, match="backward"):
        dynamo_backend("iree", backward="ignore")


def test_eager_backend_and_callable_names():
    torch.manual_seed(0)
    model = Gates().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        _assert_close(torch.compile(model, backend=fx_rewrites_eager, dynamic=True)(x), model(x))
    assert fx_rewrites_iree.__name__ == "fx_rewrites_iree" and fx_rewrites_eager.__name__ == "fx_rewrites_eager"
    assert {"iree", "eager"} <= set(backends.names())


def test_entry_point_names():
    # needs the torch_dynamo_backends entry points of pyproject.toml (pip install -e .)
    assert {"fx_rewrites_iree", "fx_rewrites_eager"} <= set(torch._dynamo.list_backends())
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(3, 16)
    with torch.no_grad():
        for name in ("fx_rewrites_iree", "fx_rewrites_eager"):
            torch._dynamo.reset()
            _assert_close(torch.compile(model, backend=name)(x), model(x))


# -- a detection model (torchvision) ---------------------------------------------------------


@pytest.mark.slow
def test_faster_rcnn_through_torch_compile():
    """torchvision's Faster R-CNN (random weights) through torch.compile(backend="fx_rewrites_iree"), two image sets.

    nms is data-dependent: dynamo breaks the graph there and it runs eagerly
    (tests/zoo/torchvision_cpu.py provides it on CPU torch); the graphs
    around it run on IREE. roi_align's bilinear gather indexes with int32
    tensors, which IREE rejects (`int32_index_to_int64_for_iree` casts them).

    The reference runs under torch.compile's stance "force_eager": without torchvision's compiled ops, roi_align's
    Python path is wrapped in torch.compile (torchvision's `lazy_compile`), so the reference's first call compiled
    it with Inductor (about 50 CPU s on an AVX2 EPYC, a third of this test) instead of running it eagerly.
    """
    from tests.zoo import torchvision_cpu

    torchvision_cpu.install()
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=3,
        min_size=64,
        max_size=64,
        box_score_thresh=0.0,
        rpn_pre_nms_top_n_test=50,
        rpn_post_nms_top_n_test=20,
        box_detections_per_img=10,
    ).eval()
    compiled = torch.compile(model, backend="fx_rewrites_iree", dynamic=False)
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        images = [torch.rand(3, 64, 64, generator=g) for _ in range(2)]
        with torch.no_grad():
            with torch.compiler.set_stance("force_eager"):
                expected = model(images)
            got = compiled(images)
        _assert_close(got, expected)
