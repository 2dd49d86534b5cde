"""Training under torch.compile(backend=fx_rewrites_iree): the forward graphs run on IREE, the backward on eager.

A grad-enabled forward returns what its backward saves, so ops that inference
graphs call for their first output only are called for all of them: the CPU
flash attention kernel's logsumexp, eval-mode batch norm's saved statistics.
These tests take those graphs from real models (a tiny BERT, a conv net with
BatchNorm) and check that the rules make them compile (no
`EagerFallbackWarning`: each graph ran on IREE) and match eager.
"""

from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
import torch.nn.functional as F

from fx_rewrites import apply
from fx_rewrites.backends.dynamo import CompiledGraph, EagerFallbackWarning, dynamo_backend
from fx_rewrites.backends.iree import IreeCompiled
from fx_rewrites.backends.iree.rules.attention import flash_attention_for_cpu_with_logsumexp
from fx_rewrites.rules.composites import batch_norm_eval_to_affine
from fx_rewrites.ruleset import RuleSet

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
BN_EVAL = aten._native_batch_norm_legit_no_training.default


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _no_fallback(graphs: list[CompiledGraph]) -> None:
    assert graphs, "nothing was compiled"
    for g in graphs:
        assert not g.fallback, g.fallback
        assert isinstance(g.compiled, IreeCompiled), g.compiled


def _reads_output(gm: torch.fx.GraphModule, op, index: int) -> bool:
    return any(
        u.target is operator.getitem and u.args[1] == index
        for n in gm.graph.find_nodes(op="call_function", target=op)
        for u in n.users
    )


def _real_inputs(gm: torch.fx.GraphModule, seed: int, *, positive: bool = False) -> list[torch.Tensor]:
    """Random inputs of the graph's placeholders' shapes (`positive`: in [0.5, 1.5), for a running variance)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in gm.graph.find_nodes(op="placeholder"):
        val = p.meta["val"]
        assert val.dtype.is_floating_point, p
        x = torch.randn(tuple(val.shape), generator=g, dtype=val.dtype)
        out.append(x.abs() + 0.5 if positive else x)
    return out


# -- attention whose logsumexp the training forward saves ------------------------------------------------------


class Attention(torch.nn.Module):
    def __init__(self, causal: bool = False) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.causal = causal

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal).transpose(1, 2).flatten(2)


@pytest.mark.parametrize("form", ["no_mask", "float_mask", "causal"])
def test_flash_attention_with_logsumexp_graph(form):
    """The rule on the training forward torch.compile gives (recorded by the eager backend): the kernel goes,
    and the rewritten graph gives the kernel's outputs, logsumexp included, on two input sets."""
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = Attention(causal=form == "causal")
    mask = torch.zeros(2, 1, 5, 5)
    mask[:, :, :, 3] = float("-inf")
    args = (torch.randn(2, 5, 16),) + ((mask,) if form == "float_mask" else ())
    torch.compile(model, backend=dynamo_backend("eager", on_graph=graphs.append))(*args).sum().backward()
    (graph,) = graphs
    gm = graph.graph_module
    assert graph.kind == "forward" and _reads_output(gm, FLASH, 1)
    result = apply(gm, RuleSet([flash_attention_for_cpu_with_logsumexp]))
    assert dict(result.report.rewrites) == {"flash_attention_for_cpu_with_logsumexp": 1}
    assert not result.graph_module.graph.find_nodes(op="call_function", target=FLASH)
    for seed in (0, 1):
        inputs = _real_inputs(gm, seed)
        if form == "float_mask":  # the mask placeholder: keep its -inf column, with a fully masked row
            (i,) = [k for k, x in enumerate(inputs) if x.shape == mask.shape]
            inputs[i] = mask.clone()
            inputs[i][1, 0, 2, :] = float("-inf")
        for got, expected in zip(result.graph_module(*inputs), gm(*inputs), strict=True):
            torch.testing.assert_close(got, expected)


def test_flash_attention_rule_leaves_unread_logsumexp_and_dropout():
    """With the logsumexp unread the SDPA rule takes the kernel; with dropout the kernel stays whole."""
    graphs: list[CompiledGraph] = []
    model = Attention()
    with torch.no_grad():
        torch.compile(model, backend=dynamo_backend("eager", on_graph=graphs.append))(torch.randn(2, 5, 16))
    (graph,) = graphs
    assert not _reads_output(graph.graph_module, FLASH, 1)
    result = apply(graph.graph_module, RuleSet([flash_attention_for_cpu_with_logsumexp]))
    assert not result.report.rewrites


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("form", ["float_mask", "causal"])
def test_attention_trains_on_iree(form, dynamic):
    """Output and gradients (the kernel's backward on eager, fed the written-out logsumexp) match eager; with
    dynamic=True on two sequence lengths, one graph for both."""
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = Attention(causal=form == "causal")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=dynamo_backend("iree", on_graph=graphs.append), dynamic=dynamic)
    for seed, n in ((0, 5), (1, 7 if dynamic else 5)):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, n, 16, generator=g)
        mask = torch.where(torch.rand(2, 1, n, n, generator=g) < 0.3, float("-inf"), 0.0)
        args = (x,) + ((mask,) if form == "float_mask" else ())
        with warnings.catch_warnings():
            warnings.simplefilter("error", EagerFallbackWarning)
            warnings.filterwarnings("ignore", "compiles inference and forward graphs only")
            got = compiled(*args)
            got.square().sum().backward()
        expected = reference(*args)
        expected.square().sum().backward()
        torch.testing.assert_close(got, expected)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    _no_fallback(graphs)
    assert len(graphs) == 1 and graphs[0].result.report.rewrites["flash_attention_for_cpu_with_logsumexp"] == 1


def test_training_forward_the_backend_cannot_compile_runs_on_eager(monkeypatch):
    """Without the rules the kernel reaches IREE, which cannot compile it: the forward runs on eager with one
    warning naming the kernel, the backward on eager as always, and the gradients are eager's."""
    monkeypatch.delenv("FX_REWRITES_STRICT")  # a user's default (tests/conftest.py sets it for the other tests)
    graphs: list[CompiledGraph] = []
    torch.manual_seed(0)
    model = Attention()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=dynamo_backend("iree", rules=RuleSet([]), on_graph=graphs.append))
    x = torch.randn(2, 5, 16)
    with pytest.warns(EagerFallbackWarning) as caught:
        warnings.filterwarnings("ignore", "compiles inference and forward graphs only")
        compiled(x).square().sum().backward()
    fallbacks = [w for w in caught if issubclass(w.category, EagerFallbackWarning)]
    assert len(fallbacks) == 1
    assert "this forward graph" in str(fallbacks[0].message)
    assert "`aten._scaled_dot_product_flash_attention_for_cpu` stopped its compile" in str(fallbacks[0].message)
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    (graph,) = graphs
    assert graph.fallback and graph.compiled is graph.graph_module


# -- eval-mode batch norm called with grad enabled -------------------------------------------------------------


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten())
    with torch.no_grad():  # running statistics other than 0 and 1
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    return net.eval()


def test_batch_norm_eval_with_saved_statistics_graph():
    graphs: list[CompiledGraph] = []
    net = _bn_net()
    torch.compile(net, backend=dynamo_backend("eager", on_graph=graphs.append))(torch.randn(1, 3, 8, 8))
    (graph,) = graphs
    gm = graph.graph_module
    assert graph.kind == "forward" and _reads_output(gm, BN_EVAL, 1) and _reads_output(gm, BN_EVAL, 2)
    result = apply(gm, RuleSet([batch_norm_eval_to_affine]))
    assert dict(result.report.rewrites) == {"batch_norm_eval_to_affine": 1}
    assert not result.graph_module.graph.find_nodes(op="call_function", target=BN_EVAL)
    for seed in (0, 1):
        inputs = _real_inputs(gm, seed, positive=True)
        outputs = gm(*inputs)
        assert [tuple(x.shape) for x in outputs if x.dim() == 1 and x.numel() == 0] == [(0,), (0,)]
        for got, expected in zip(result.graph_module(*inputs), outputs, strict=True):
            torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_batch_norm_eval_trains_on_iree(dynamic):
    graphs: list[CompiledGraph] = []
    net = _bn_net()
    reference = copy.deepcopy(net)
    compiled = torch.compile(net, backend=dynamo_backend("iree", on_graph=graphs.append), dynamic=dynamic)
    for seed, size in ((0, 8), (1, 10 if dynamic else 8)):
        x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))
        with warnings.catch_warnings():
            warnings.simplefilter("error", EagerFallbackWarning)
            warnings.filterwarnings("ignore", "compiles inference and forward graphs only")
            got = compiled(x)
            got.sum().backward()
        expected = reference(x)
        expected.sum().backward()
        torch.testing.assert_close(got, expected)
        for (name, p), q in zip(net.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    _no_fallback(graphs)
    assert len(graphs) == 1 and graphs[0].kind == "forward"
    assert graphs[0].result.report.rewrites["batch_norm_eval_to_affine"] == 1


# -- a tiny BERT fine-tunes as on eager --------------------------------------------------------------------------


def test_tiny_bert_fine_tunes_like_eager():
    """5 AdamW steps of a tiny BERT classifier (random seeded weights, dropout 0 so both runs are deterministic,
    the same batches): each step's loss under torch.compile(backend=fx_rewrites_iree) equals eager's within 1e-5,
    and every forward graph ran on IREE."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).train()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(5):
        ids = torch.randint(0, 100, (4, 12), generator=g)
        mask = torch.ones(4, 12, dtype=torch.long)
        mask[1, 9:] = 0
        mask[3, 6:] = 0
        batches.append((ids, mask, torch.randint(0, 3, (4,), generator=g)))

    def fine_tune(run, params) -> list[float]:
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        losses = []
        for ids, mask, labels in batches:
            optimizer.zero_grad()
            loss = run(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    graphs: list[CompiledGraph] = []
    compiled = torch.compile(model, backend=dynamo_backend("iree", on_graph=graphs.append))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)
        warnings.filterwarnings("ignore", "compiles inference and forward graphs only")
        got = fine_tune(compiled, model.parameters())
    expected = fine_tune(reference, reference.parameters())
    print("losses, compiled:", got, "eager:", expected)
    assert len(set(expected)) == 5  # the model learns: each step is a new number
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - b) <= 1e-5, f"step {step}: compiled {a} against eager {b}"
    _no_fallback(graphs)
    assert {g.kind for g in graphs} == {"forward"}
    assert sum(g.result.report.rewrites.get("flash_attention_for_cpu_with_logsumexp", 0) for g in graphs) >= 2
