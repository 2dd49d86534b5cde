"""IREE parameter archives (.irpa) written from Python, a tensor at a time: no copy of the weights in memory.

`iree.runtime.ParameterIndex.create_archive_file` maps the new file and copies every buffer into the mapping,
so the archive's dirty pages count in the writer's RSS, a second full copy of the weights while it writes.
`write` lays the file out as IREE's builder does (`iree/io/formats/irpa/irpa_builder.c`, the format in
`iree/schemas/parameter_archive.h`: a header, the entry table, the names, then each entry's bytes at a 64-byte
aligned offset, the file padded to 4 KiB) and writes each tensor's own memory with `write(2)`: the bytes pass
through the page cache, never the process's memory. The file is byte for byte the one IREE writes
(tests/backends/iree/test_archive.py). `reserve` writes the header and table only, the data left as a hole for
IREE's parameter encoder to fill (`encoding.py`). `replacing` gives each writer a new file that is renamed
over the old one when it is complete: a module that maps the old archive keeps its pages.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

MAGIC = 0x41505249  # "IRPA"
_HEADER = struct.Struct("<IHHQQQQ6Q")  # prefix (magic, version, header size, next header, flags), v0 fields
_ENTRY = struct.Struct("<QIQQQQQQQQ")  # entry header (size, type, flags, name, metadata, alignment), storage
_DATA = 2  # IREE_IO_PARAMETER_ARCHIVE_ENTRY_TYPE_DATA
HEADER_ALIGNMENT = ENTRY_ALIGNMENT = 16
DATA_ALIGNMENT = 64
FILE_ALIGNMENT = 4096


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def layout(entries: Iterable[tuple[str, int, int]]) -> tuple[bytes, list[int], int]:
    """The archive's head (header, entry table, names) for `entries` (key, length, alignment), each entry's
    absolute file offset, and the file's size."""
    entries = list(entries)
    names = [key.encode() for key, _, _ in entries]
    table_at = _align(_HEADER.size, HEADER_ALIGNMENT)
    stride = _align(_ENTRY.size, ENTRY_ALIGNMENT)
    table_length = (len(entries) - 1) * stride + _ENTRY.size if entries else 0
    names_at = table_at + table_length
    names_length = sum(len(n) for n in names)
    storage_at = _align(names_at + names_length, max((a for _, _, a in entries), default=1))
    offsets, cursor = [], 0
    for _, length, alignment in entries:
        cursor = _align(cursor, alignment)
        offsets.append(cursor)
        cursor += length
    segments = (table_at, table_length, names_at, names_length, storage_at, cursor)
    header = _HEADER.pack(MAGIC, 0, 0, _HEADER.size, 0, 0, len(entries), *segments)
    table, name_at = [], 0
    for name, (_, length, alignment), offset in zip(names, entries, offsets, strict=True):
        table.append(_ENTRY.pack(_ENTRY.size, _DATA, 0, name_at, len(name), 0, 0, alignment, offset, length))
        name_at += len(name)
    head = header.ljust(table_at, b"\0") + b"".join(e.ljust(stride, b"\0") for e in table)[:table_length]
    size = _align(storage_at + cursor, FILE_ALIGNMENT)
    return head + b"".join(names), [storage_at + o for o in offsets], size


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A new path beside `path` (not yet a file) to write the file at `path` into: renamed over `path` when the
    block ends, removed when it raises. A module that maps the file now at `path` (a loaded module, a compiled
    one reading the archive it was saved with) keeps reading that file's pages, which writing into `path` in
    place would change under it (or take away: SIGBUS, when the file is truncated)."""
    path = Path(path)
    new = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        yield new
        os.replace(new, path)
    except BaseException:
        new.unlink(missing_ok=True)
        raise


def write(arrays: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """An .irpa holding `arrays` (key -> a contiguous buffer: a numpy array, a memoryview) as IREE writes it,
    each written from its own memory (into a new file renamed over `path`: `replacing`)."""
    views = {key: memoryview(array).cast("B") for key, array in arrays.items()}
    head, offsets, size = layout((key, view.nbytes, DATA_ALIGNMENT) for key, view in views.items())
    with replacing(path) as new, new.open("wb") as f:
        f.write(head)
        for view, offset in zip(views.values(), offsets, strict=True):
            f.write(b"\0" * (offset - f.tell()))
            f.write(view)
        f.truncate(size)


def reserve(entries: Iterable[tuple[str, int, int]], path: str | os.PathLike[str]) -> list[int]:
    """An .irpa with `entries` (key, length, alignment) whose data is zeros (a hole in the file, to be written
    in place): each entry's absolute file offset."""
    head, offsets, size = layout(entries)
    with Path(path).open("wb") as f:
        f.write(head)
        f.truncate(size)
    return offsets


def read_entry(path: str | os.PathLike[str], key: str) -> bytes | None:
    """The bytes of entry `key` of the .irpa at `path` (as `layout` and IREE's builder lay it out), or None
    where the archive has no such entry; read without mapping the weights."""
    with Path(path).open("rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return None
        magic, _, _, _, _, _, count, table_at, _, names_at, _, storage_at, _ = _HEADER.unpack(head)
        if magic != MAGIC:
            return None
        stride = _align(_ENTRY.size, ENTRY_ALIGNMENT)
        f.seek(table_at)
        table = f.read(stride * count)
        wanted = key.encode()
        for i in range(count):
            fields = _ENTRY.unpack_from(table, i * stride)
            name_at, name_length, offset, length = fields[3], fields[4], fields[8], fields[9]
            if fields[1] != _DATA or name_length != len(wanted):
                continue
            f.seek(names_at + name_at)
            if f.read(name_length) == wanted:
                f.seek(storage_at + offset)
                return f.read(length)
    return None
