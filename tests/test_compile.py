"""`fx_rewrites.compile`: export, the backend's rules and compile in one call; the result is called like the model.

Each test compiles a small model on IREE (llvm-cpu), about a second per compile.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites.app.compile import Compiled, ExportFailed
from fx_rewrites.backends.convention import InputMismatch
from fx_rewrites.backends.iree import IreeCompileError
from fx_rewrites.backends.iree.artifact import ArtifactError
from fx_rewrites.backends.iree.runtime import to_host


class Gated(torch.nn.Module):
    """Exports with max_pool2d's stride missing and a lifted `torch.tensor` constant (lift_fresh_copy +
    detach_, which IREE rejects as exported); takes a tensor keyword and a flag that changes the output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, use_cache: bool = True):
        y = F.max_pool2d(self.conv(x), 2) + torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1, 1)
        y = y * mask
        return (y, y.sum()) if use_cache else y


def _model() -> Gated:
    torch.manual_seed(0)
    return Gated().eval()


def _inputs(batch: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 8, 8, generator=g), (torch.rand(1, 4, 1, 1, generator=g) > 0.3).float()


@pytest.fixture(scope="module")
def compiled() -> Compiled:
    x, mask = _inputs()
    return fx_rewrites.compile(_model(), (x,), {"mask": mask, "use_cache": False})


def test_compile_with_kwargs_is_called_like_the_model(compiled):
    model = _model()
    assert isinstance(compiled, Compiled) and compiled.backend == "iree"
    fired = compiled.report.rewrites
    assert fired.get("pool_stride_defaults") == 1 and fired.get("drop_detach_") == 1, fired
    for seed in (1, 2):  # two input sets
        x, mask = _inputs(seed=seed)
        expected = model(x, mask=mask, use_cache=False)
        # use_cache, a constant when it was compiled, need not be repeated; passing the same value works too
        torch.testing.assert_close(compiled(x, mask=mask), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(compiled(x, mask=mask, use_cache=False), expected, rtol=1e-4, atol=1e-5)


def test_as_exported_iree_rejects_it():
    """The one call applies the rules: the same program without them does not compile."""
    x, mask = _inputs()
    ep = torch.export.export(_model(), (x,), {"mask": mask, "use_cache": False})
    with pytest.raises(IreeCompileError, match="detach_"):
        backends.get("iree").compile(ep, (x,))


def test_wrong_calls_name_the_argument_and_the_fix(compiled):
    x, mask = _inputs()
    with pytest.raises(
        TypeError, match=r"keyword argument 'mask' \(a float32 tensor of shape \(1, 4, 1, 1\)\) is miss"
    ):
        compiled(x)
    with pytest.raises(TypeError, match=r"1 positional argument, got 2.*Fix: call it as the model was called"):
        compiled(x, mask, use_cache=False)
    with pytest.raises(TypeError, match=r"unexpected keyword argument \['scale'\]"):
        compiled(x, mask=mask, scale=2.0)
    # a different value for a constant would silently compute the other branch's graph: refused
    with pytest.raises(
        InputMismatch, match=r"input 'use_cache' \(kwargs\['use_cache'\]\) is True; .* compiled with False"
    ):
        compiled(x, mask=mask, use_cache=True)


def test_a_batch_mismatch_names_the_input_the_shapes_and_dynamic_shapes(compiled):
    x, mask = _inputs(batch=3)
    with pytest.raises(InputMismatch) as info:
        compiled(x, mask=mask)
    message = str(info.value)
    assert "input 'x' (args[0]) has shape (3, 3, 8, 8); the compiled program takes (2, 3, 8, 8)" in message
    assert "dim 0 is 3, compiled for 2" in message
    # an entry per argument: torch.export refuses a dict without the keyword arguments ('use_cache': None too)
    hint = "dynamic_shapes={'x': {0: torch.export.Dim('batch')}, 'mask': None, 'use_cache': None}"
    assert f"fx_rewrites.compile(model, args, kwargs, {hint})" in message
    shapes = eval(hint.split("=", 1)[1], {"torch": torch})
    x2, mask2 = _inputs(batch=2)
    ep = torch.export.export(_model(), (x2,), {"mask": mask2, "use_cache": False}, dynamic_shapes=shapes)
    x_val = next(n for n in ep.graph.nodes if n.name == ep.graph_signature.user_inputs[0]).meta["val"]
    assert isinstance(x_val.shape[0], torch.SymInt)  # the hint, as given, makes the batch dynamic
    # what IREE itself says when the check is bypassed: the raw text the check replaces
    runtime = compiled.runtime
    with pytest.raises(ValueError, match=r"buffer_diagnostics\.c.*tensor shape dimension 0 mismatch"):
        runtime.function(*(to_host(t) for t in (x, mask)))
    with pytest.raises(InputMismatch, match=r"input 'x' \(args\[0\]\) is a float64 tensor; .* takes float32"):
        compiled(x[:2].double(), mask=mask)
    with pytest.raises(InputMismatch, match=r"input 'mask' \(kwargs\['mask'\]\) is not a tensor \(got float\)"):
        compiled(x[:2], mask=1.0)


def test_dynamic_shapes_take_any_batch_in_range():
    model = _model()
    x, mask = _inputs(batch=2)
    batch = torch.export.Dim("batch", min=1, max=4)
    compiled = fx_rewrites.compile(
        model,
        (x,),
        {"mask": mask, "use_cache": False},
        dynamic_shapes={"x": {0: batch}, "mask": None, "use_cache": None},
    )
    for n in (1, 3, 4):
        x, mask = _inputs(batch=n, seed=n)
        torch.testing.assert_close(compiled(x, mask=mask), model(x, mask=mask, use_cache=False), rtol=1e-4, atol=1e-5)
    x, mask = _inputs(batch=5)
    with pytest.raises(InputMismatch, match=r"dim 0 \(s\w+\) is 5, outside the range \[1, 4\]"):
        compiled(x, mask=mask)


def test_takes_an_exported_program_or_a_graph_module():
    class Net(torch.nn.Module):
        def forward(self, x):
            return F.avg_pool2d(torch.relu(x), 2)

    x = torch.randn(1, 2, 4, 4)
    ep = torch.export.export(Net(), (x,))
    from_ep = fx_rewrites.compile(ep, (x,))
    assert from_ep.report.rewrites.get("pool_stride_defaults") == 1
    traced = torch.fx.symbolic_trace(Net())  # an nn.Module: exported first
    for compiled in (from_ep, fx_rewrites.compile(traced, (x,))):
        torch.testing.assert_close(compiled(x), Net()(x))
    with pytest.raises(TypeError, match="already carries its shapes"):
        fx_rewrites.compile(ep, (x,), dynamic_shapes={"x": {0: torch.export.Dim("b")}})
    with pytest.raises(TypeError, match=r"takes a torch.nn.Module .* got function"):
        fx_rewrites.compile(lambda x: x, (x,))
    with pytest.raises(TypeError, match="tuple of the model's positional inputs"):
        fx_rewrites.compile(Net(), x)


def test_export_failures_say_what_to_change():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x + 1 if x.sum() > 0 else x - 1

    with pytest.raises(ExportFailed, match=r"torch.export could not export Branchy: .*Fix: .*torch.cond"):
        fx_rewrites.compile(Branchy(), (torch.ones(2),))


@pytest.mark.slow  # a (tiny) transformers model: the import and export take ~20 s on the shared machine
def test_a_cache_in_the_outputs_gets_the_use_cache_hint():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 32, (1, 6))
    with pytest.raises(ExportFailed) as info:
        fx_rewrites.compile(model, (ids,), {"use_cache": True})
    message = str(info.value)
    assert "DynamicCache" in message and "pass use_cache=False in kwargs" in message
    assert "draft_export" not in message
    compiled = fx_rewrites.compile(model, (ids,), {"use_cache": False})
    expected = model(ids, use_cache=False).logits
    torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-4, atol=1e-5)


def test_eager_backend_runs_and_writes_no_artifact(tmp_path):
    x, mask = _inputs()
    compiled = fx_rewrites.compile(_model(), (x,), {"mask": mask, "use_cache": False}, backend="eager")
    torch.testing.assert_close(compiled(x, mask=mask, use_cache=False), _model()(x, mask=mask, use_cache=False))
    with pytest.raises(ArtifactError, match=r"the eager backend writes no artifact\. Fix: compile with backend=.iree."):
        compiled.save(tmp_path / "model.vmfb")


def test_rules_that_stop_short_warn_before_the_backend_compiles():
    """A backend's rules that do not reach their fixpoint may leave out a rewrite the backend needs: say so."""
    from fx_rewrites.backends.eager import EagerBackend
    from fx_rewrites.ruleset import RuleSet
    from tests.conftest import AddRelu
    from tests.engine import rules as r

    args = (torch.randn(3, 4), torch.randn(3, 4))
    looping = EagerBackend(rules=RuleSet([r.add_to_sub, r.sub_to_add]))
    match = r"eager backend's rules stopped before their fixpoint \(non-convergence: rules .* undo each other"
    with pytest.warns(RuntimeWarning, match=match):
        compiled = fx_rewrites.compile(AddRelu(), args, backend=looping)
    torch.testing.assert_close(compiled(*args), AddRelu()(*args))  # each rewrite was right, only unfinished
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fx_rewrites.compile(AddRelu(), args, backend="eager")


def test_a_user_script_sees_no_torch_pytree_warning(tmp_path):
    """torch 2.13 warns about its own pytree code (`isinstance(treespec, LeafSpec)` is deprecated) when a
    program is copied or exported; fx-rewrites silences it where it triggers it, not for the whole process."""
    script = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("error", FutureWarning)     # any FutureWarning raised by our calls fails
        import torch, fx_rewrites
        from fx_rewrites import backends

        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
        x = torch.randn(2, 4)
        compiled = fx_rewrites.compile(model, (x,))
        compiled(x)
        compiled.save("m.vmfb")
        fx_rewrites.load("m.vmfb")(x)
        with warnings.catch_warnings():                   # the user's own export: torch's warning is theirs
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, (x,))
        result = fx_rewrites.apply(ep)
        backends.get("iree").compile(result.program, (x,))(x)
        # the filter was not left switched off for the user's code
        from torch.utils import _pytree
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
        assert len(caught) == 1, caught
        print("clean")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr[-3000:]
    assert "FutureWarning" not in proc.stderr, proc.stderr[-3000:]


def test_no_nanobind_leak_report_after_torch_compile_with_a_graph_break(tmp_path):
    """A graph break keeps dynamo's compiled graphs (and IREE's runtime objects in them) alive to the end;
    left to interpreter shutdown they outlive their nanobind module, which printed ~100 `leaked` lines."""
    script = textwrap.dedent(
        """
        import torch, fx_rewrites

        def f(x):
            y = torch.relu(x) * 2
            print("graph break")
            return y + 1

        with torch.no_grad():
            out = torch.compile(f, backend="fx_rewrites_iree")(torch.randn(4))
        print("done", out.shape)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0 and "done torch.Size([4])" in proc.stdout, proc.stderr[-3000:]
    assert "nanobind" not in proc.stderr, proc.stderr[-3000:]


class RunningMean(torch.nn.Module):
    """Updates two buffers in forward (a running mean and a call counter), as BatchNorm in training does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("calls", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        self.calls.add_(1)
        return self.lin(x) - self.mean * self.calls


@pytest.mark.parametrize("backend", ["eager", "iree"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dim"])
def test_compiled_and_its_program_never_share_state(backend, dynamic):
    """Issue 27: `compiled.program.module()` and `compiled` wrote one running mean, so a call of one moved
    the other's state (off by ~0.09 here against two eager calls, 0.884 in the report). Each owns its own."""
    torch.manual_seed(0)
    model = RunningMean()
    reference = copy.deepcopy(model)
    xs = [torch.randn(3, 4), torch.randn(5 if dynamic else 3, 4)]
    shapes = ({0: torch.export.Dim("n")},) if dynamic else None
    compiled = fx_rewrites.compile(model, (xs[0],), backend=backend, dynamic_shapes=shapes)
    program_module = compiled.program.module()
    with torch.no_grad():
        expected = [reference(x) for x in xs]
        torch.testing.assert_close(program_module(xs[0]), expected[0], rtol=1e-5, atol=1e-6)
        for x, want in zip(xs, expected, strict=True):  # the program's call did not move compiled's state
            torch.testing.assert_close(compiled(x), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(program_module(xs[1]), expected[1], rtol=1e-5, atol=1e-6)  # nor the reverse
