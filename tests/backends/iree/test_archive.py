"""`backends/iree/archive.py`: .irpa files written a tensor at a time are the files IREE's own builder writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fx_rewrites.backends.iree import archive
from fx_rewrites.backends.iree.parameters import _bytes, write_archive

iree_runtime = pytest.importorskip("iree.runtime")

CASES = {
    "empty": {},
    "one": {"fc.weight": torch.randn(64, 32)},
    # odd lengths (each entry's data 64-byte aligned), long and short names, several dtypes
    "mixed": {
        "a": torch.arange(10, dtype=torch.uint8),
        "bb": torch.arange(3, dtype=torch.int16),
        "layers.0.self_attn.q_proj.weight" * 3: torch.randn(7, 5),
        "cache_0_keys": torch.zeros(2, 3, 4, dtype=torch.bfloat16),
        "c": torch.tensor([True, False, True]),
    },
}


def iree_archive(tensors, path):
    index = iree_runtime.ParameterIndex()
    for key, tensor in tensors.items():
        index.add_buffer(key, _bytes(tensor))
    index.create_archive_file(str(path))


@pytest.mark.parametrize("case", CASES)
def test_the_file_is_byte_for_byte_the_one_iree_writes(case, tmp_path):
    tensors = CASES[case]
    write_archive(tensors, tmp_path / "ours.irpa")
    iree_archive(tensors, tmp_path / "iree.irpa")
    assert (tmp_path / "ours.irpa").read_bytes() == (tmp_path / "iree.irpa").read_bytes()
    # and IREE reads every entry back as the tensor's bytes
    index = iree_runtime.ParameterIndex()
    index.load(str(tmp_path / "ours.irpa"))
    read = {entry.key: np.array(entry.file_view, copy=True) for entry in (index[i] for i in range(len(index)))}
    assert sorted(read) == sorted(tensors)
    for key, tensor in tensors.items():
        assert read[key].tobytes() == _bytes(tensor).tobytes(), key


def test_written_from_the_tensors_memory(tmp_path, monkeypatch):
    """Each tensor's own memory goes to write(2): no bytes object of the archive (or of a tensor) is made."""
    tensor = torch.randn(256, 256)
    written = []
    real_write = archive.Path.open

    class Recorder:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            written.append(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(archive.Path, "open", lambda self, mode: Recorder(real_write(self, mode)))
    write_archive({"w": tensor}, tmp_path / "w.irpa")
    views = [w for w in written if isinstance(w, memoryview)]
    assert len(views) == 1 and views[0].nbytes == tensor.numel() * 4
    assert np.shares_memory(np.asarray(views[0]), tensor.numpy())
    assert all(len(w) < 4096 for w in written if isinstance(w, bytes))  # the head and padding only


def test_reserve_leaves_room_the_encoder_fills(tmp_path):
    offsets = archive.reserve([("parameter0", 1000, 64), ("x", 10, 64)], tmp_path / "r.irpa")
    index = iree_runtime.ParameterIndex()
    index.load(str(tmp_path / "r.irpa"))
    entries = {index[i].key: index[i] for i in range(len(index))}
    assert sorted(entries) == ["parameter0", "x"]
    assert len(np.array(entries["parameter0"].file_view)) == 1000
    assert offsets[1] - offsets[0] == 1024 and offsets[0] % 64 == 0


@pytest.mark.parametrize("case", ["one", "mixed"])
def test_an_entry_read_back_from_iree_s_own_file(case, tmp_path):
    """`read_entry` over a file IREE's builder wrote: each entry's bytes, None for a key it lacks."""
    tensors = CASES[case]
    iree_archive(tensors, tmp_path / "iree.irpa")
    for key, tensor in tensors.items():
        assert archive.read_entry(tmp_path / "iree.irpa", key) == _bytes(tensor).tobytes(), key
    assert archive.read_entry(tmp_path / "iree.irpa", "fc.weigh") is None  # a prefix of a key is not the key
    assert archive.read_entry(tmp_path / "iree.irpa", "absent") is None
    (tmp_path / "not.irpa").write_bytes(b"not an archive")
    assert archive.read_entry(tmp_path / "not.irpa", "a") is None
