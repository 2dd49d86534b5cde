"""benchmarks/int4_nibbles.py: the nibble packing round-trips every int4 pair exactly, and the nibble and integer
product forms compile through IREE with their packed bytes kept (not folded to float32) and compute what torch does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from int4_nibbles import UNIT, mutable_weight, pack_nibbles, unpack_nibbles  # noqa: E402


def test_every_pair_of_int4_values_unpacks_to_itself_times_2_to_the_28():
    values = torch.arange(-8, 8, dtype=torch.int8)
    low, high = torch.meshgrid(values, values, indexing="ij")
    pairs = torch.stack([low.flatten(), high.flatten()], 1)  # [256, 2]: every (low, high)
    packed = pack_nibbles(pairs, 1)
    assert packed.shape == (256, 1) and packed.dtype == torch.int8
    assert len(set(packed.flatten().tolist())) == 256  # every byte once
    unpacked = unpack_nibbles(packed, 1)  # [256, 2, 1]
    assert torch.equal(unpacked.squeeze(2) * UNIT, pairs.to(torch.float32))


def test_mutable_weight_replaces_every_literal_of_the_weight():
    weight = torch.tensor([[1, -2], [3, -128]], dtype=torch.int8)
    line = "    %{} = torch.vtensor.literal(dense_resource<w> : tensor<2x2xsi8>) : !torch.vtensor<[2,2],si8>"
    mlir = "\n".join(["module {", line.format(1), line.format(2), "}"])
    out = mutable_weight(mlir, weight)
    assert 'util.global private mutable @packed_weight = dense<"0x01FE0380"> : tensor<2x2xi8>' in out
    assert out.count("util.global.load @packed_weight") == 2 and "vtensor.literal" not in out
    with pytest.raises(ValueError, match="no int8 literal"):
        mutable_weight(mlir, weight.view(4, 1))


FORMS = ("int4_tiles4_symmetric", "int4_nibbles_two", "int4_nibbles_axes", "int4_i8_products")


@pytest.mark.slow  # four IREE compiles
# 512 x 1024: a float32 copy of the unpacked weight grows it by 1.8 MB, past IREE's hoisting threshold; on a 64 x 128
# weight IREE makes the never-stored global immutable and folds the unpacking into float32 constants at compile time
def test_nibble_forms_keep_their_bytes_and_compute_what_torch_does(tmp_path, monkeypatch):
    args = ["--n", "512", "--k", "1024", "--rows", "2", "--repetitions", "2", "--keep", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "int4_forms.py"), *args, "--forms", ",".join(FORMS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in done.stdout.splitlines() if line[:2] == "| "}
    for form in FORMS:
        ms, diff, iree_diff = float(rows[form][0]), float(rows[form][2]), float(rows[form][3])
        assert ms > 0, rows[form]
        assert iree_diff == 0, rows[form]  # the compiled module's output equals the torch module's
        assert diff < (0.1 if "i8" in form else 1e-5), rows[form]  # int8 x: other values than the float forms
    import int4_forms

    monkeypatch.setattr(int4_forms, "BLOCK", 16)  # the subprocess's default; put back after the test
    w, q, q8, s8, s, z = int4_forms.weights(512, 1024, 32)
    for form in ("int4_nibbles_two", "int4_nibbles_axes"):
        module = int4_forms.FORMS[form](w, q, q8, s8, s, z, 32)
        vmfb = (tmp_path / f"{form}.vmfb").read_bytes()
        assert module.p.numpy().tobytes() in vmfb  # the packed bytes, stored as they are
        unpacked = (unpack_nibbles(module.p, 2) * UNIT).flatten()  # the values, were they folded to float32
        assert unpacked[:64].numpy().tobytes() not in vmfb
