"""Every ttnn call the backend makes, checked against the real ttnn 0.81.1 package (tools/ttnn_check).

The models below run on the test double through a Recorder; the recorded calls
(every stand-in's dispatch is exercised) go to `tools/ttnn_check/check_calls.py`,
run with the Python that has the real ttnn (`FX_REWRITES_TTNN_PYTHON`, set up
by `tools/ttnn_check/setup.sh`; .ci/run does both). Without it the tests are
skipped locally and FAIL in CI (`CI` set): real ttnn must be checked there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fx_rewrites import backends
from fx_rewrites import testing as rt
from fx_rewrites.backends.ttnn import dispatch, lower, runtime
from fx_rewrites.backends.ttnn.rules import ops
from tests.backends.ttnn import reference_ttnn
from tests.backends.ttnn.models import CASES
from tests.backends.ttnn.recording import Recorder
from tests.outside import missing

ROOT = Path(__file__).resolve().parents[3]
CHECKER = ROOT / "tools" / "ttnn_check" / "check_calls.py"


def _ttnn_python() -> str:
    python = os.environ.get("FX_REWRITES_TTNN_PYTHON", "")
    if python and Path(python).exists():
        return python
    missing(
        "REAL TTNN API NOT CHECKED: FX_REWRITES_TTNN_PYTHON is not set to a Python with ttnn 0.81.1",
        "`bash tools/ttnn_check/setup.sh DIR` and FX_REWRITES_TTNN_PYTHON=DIR/bin/python (.ci/run does)",
    )


class Extras(torch.nn.Module):
    """What CASES leave out: front padding, a narrow embedding, attention masks to expand, a full addmm addend,
    and the composed lowerings (xlogy, all, slice/select_scatter, relu6)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 8)

    def forward(self, ids, q, mask, c, a, b):
        padded = F.pad(q, (1, 1, 2, 0))
        att = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        causal = torch.ones(5, 5, dtype=torch.bool).tril()
        bool_att = F.scaled_dot_product_attention(q, q, q, attn_mask=causal)
        head, tail = torch.split(q * 1.0, [3, 5], dim=-1)
        filled = (q * 2.0).masked_fill(q.gt(0.5).to(torch.float32).to(torch.bool), -1e9)
        pooled = F.avg_pool2d(q * 1.0, 3, 1, 1, count_include_pad=False)
        made = torch.arange(5) * q[0, 0, 0, :5] + torch.ones(5) + torch.zeros_like(q[0, 0, 0, :5])
        outs = (self.emb(ids) * 2.0, padded * 1.5, att, torch.addmm(c, a, b), bool_att, head + 1.0, tail * 2.0)
        x = q * 1.0
        more = (
            F.elu(x, 0.5),
            torch.tril(x, -1),
            torch.addcmul(x, x, x, value=0.5),
            torch.addcdiv(x, x, x + 3.0, value=2.0),
            x.amin(-1),
            torch.cumsum(x, -1),
            torch.stack([x[0], x[0]], 1),
            x.repeat(1, 2, 1, 1),
            torch.roll(x, 2, -1),
            torch.baddbmm(c.expand(2, 3, 5), a.expand(2, 3, 4) * 1.0, b.expand(2, 4, 5) * 1.0, beta=0.5, alpha=2.0),
            torch.log_softmax(x, -1),
            torch.index_select(self.emb.weight * 1.0, 0, ids[0]),
            torch.xlogy(x, x.abs()),
            torch.all(x > 0.5, -1),
            torch.slice_scatter(x, x[..., 2:4] * 2.0, -1, 2, 4),
            torch.select_scatter(x, x[..., 0] * 2.0, -1, 1),
            F.relu6(x * 8.0),
        )
        return (*outs, filled, pooled, made, *more)


EXTRAS = (
    torch.randint(0, 20, (2, 5)),
    torch.randn(2, 3, 5, 8),
    torch.randn(2, 1, 1, 5),
    torch.randn(3, 5),
    torch.randn(3, 4),
    torch.randn(4, 5),
)


def _sweep_elementwise(ttnn) -> None:
    """Every elementwise stand-in, dispatched once on device values (the models use only some)."""
    device = runtime.device(ttnn)
    x = dispatch.call(ttnn, device, ops.from_torch, (torch.rand(4, 8) + 0.5, "bfloat16", ops.TILE, True), {})
    for name in ops.UNARY:
        dispatch.call(ttnn, device, ops.OPS[name], (x,), {})
    for name in (*ops.BINARY, *ops.COMPARE):
        dispatch.call(ttnn, device, ops.OPS[name], (x, x), {})
        dispatch.call(ttnn, device, ops.OPS[f"{name}_scalar"], (x, 0.5), {})


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Run every model on the double through a Recorder; the record as JSON, and the stand-ins exercised."""
    recorder = Recorder(reference_ttnn)
    exercised: set = set()
    real_call = dispatch.call

    def call(ttnn, device, target, args, kwargs):
        recorder.record.site = ops.ttnn_name(target) + f" [{target._opname}]"
        exercised.add(target)
        return real_call(ttnn, device, target, args, kwargs)

    previous = runtime.use(recorder)
    runtime.forget_devices()
    dispatch.call = call
    try:
        models = [(cls().eval(), make()) for cls, make in CASES.values()] + [(Extras().eval(), EXTRAS)]
        for model, args in models:
            fn = backends.get("ttnn").compile(lower(rt.export(model, *args)), args)
            with torch.no_grad():
                fn(*args)
        _sweep_elementwise(recorder)
    finally:
        dispatch.call = real_call
        runtime.use(previous)
        runtime.forget_devices()
    path = tmp_path_factory.mktemp("ttnn_api") / "calls.json"
    path.write_text(recorder.record.json())
    return path, exercised


def _check(python: str, path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([python, str(CHECKER), str(path)], capture_output=True, text=True, env=env, timeout=300)


def test_every_stand_in_is_exercised(recorded):
    _, exercised = recorded
    missing = sorted(name for name, op in ops.OPS.items() if op not in exercised)
    assert not missing, f"stand-ins no recorded model dispatches (add them to Extras): {missing}"


def test_every_call_binds_to_the_real_ttnn(recorded):
    python = _ttnn_python()
    path, _ = recorded
    done = _check(python, path)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "bind to the real signatures" in done.stdout


def _broken(path: Path, tmp_path: Path, mutate) -> Path:
    record = json.loads(path.read_text())
    mutate(record)
    out = tmp_path / "broken.json"
    out.write_text(json.dumps(record))
    return out


def _first(record: dict, name: str) -> dict:
    return next(c for c in record["calls"] if c["path"] == name)


def test_a_wrong_keyword_fails(recorded, tmp_path):
    python = _ttnn_python()

    def eps(record):  # ttnn.layer_norm spells it `epsilon`
        call = _first(record, "ttnn.layer_norm")
        call["kwargs"]["eps"] = call["kwargs"].pop("epsilon")

    done = _check(python, _broken(recorded[0], tmp_path, eps))
    assert done.returncode == 1, done.stdout
    assert "ttnn.layer_norm" in done.stdout and "no parameter named 'eps'" in done.stdout


def test_a_moved_function_and_a_wrong_argument_count_fail(recorded, tmp_path):
    python = _ttnn_python()

    def moved_and_short(record):
        _first(record, "ttnn.transformer.scaled_dot_product_attention")["path"] = "ttnn.scaled_dot_product_attention"
        _first(record, "ttnn.max_pool2d")["args"].pop()  # dilation dropped: a required argument missing

    done = _check(python, _broken(recorded[0], tmp_path, moved_and_short))
    assert done.returncode == 1, done.stdout
    assert "ttnn.scaled_dot_product_attention" in done.stdout and "has no 'scaled_dot_product_attention'" in done.stdout
    assert "ttnn.max_pool2d" in done.stdout and "missing ['dilation']" in done.stdout


def test_a_tensor_where_ttnn_takes_a_number_fails(recorded, tmp_path):
    python = _ttnn_python()

    def tensor_dim(record):  # ttnn.pow takes a tensor exponent too, softmax's dim is an int only
        call = _first(record, "ttnn.softmax")
        call["kwargs"]["dim"] = call["args"][0]

    done = _check(python, _broken(recorded[0], tmp_path, tensor_dim))
    assert done.returncode == 1, done.stdout
    assert "ttnn.softmax" in done.stdout and "dim: a tensor does not bind to int" in done.stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
