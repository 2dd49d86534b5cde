"""The double's tensors, layouts, dtypes, memory configs and device; conversions to and from torch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

TILE = 32
IS_TEST_DOUBLE = True


class TtnnDoubleError(RuntimeError):
    """The double's contract was broken (what real ttnn would reject or compute wrongly)."""


@attrs.frozen
class DataType:
    name: str
    storage: torch.dtype


@attrs.frozen
class Layout:
    name: str


@attrs.frozen
class MemoryConfig:
    buffer_type: str  # "DRAM" or "L1"
    sharded: bool = False


bfloat16 = DataType("bfloat16", torch.bfloat16)
float32 = DataType("float32", torch.float32)
uint32 = DataType("uint32", torch.int64)
int32 = DataType("int32", torch.int64)
TILE_LAYOUT = Layout("TILE")
ROW_MAJOR_LAYOUT = Layout("ROW_MAJOR")
DRAM_MEMORY_CONFIG = MemoryConfig("DRAM")
L1_MEMORY_CONFIG = MemoryConfig("L1")
#: where conv2d and pooling leave their outputs in this double (real ttnn: often height-sharded in L1)
_L1_SHARDED = MemoryConfig("L1", sharded=True)
#: ttnn.open_device's default L1_SMALL size; conv2d and pooling allocate from it
DEFAULT_L1_SMALL_SIZE = 0


@attrs.define(eq=False)
class MeshDevice:
    device_id: int
    l1_small_size: int
    is_open: bool = True


def open_device(
    *,
    device_id: int,
    l1_small_size: int = DEFAULT_L1_SMALL_SIZE,
    trace_region_size: int = 0,
    dispatch_core_config: Any = None,
    worker_l1_size: int | None = None,
) -> MeshDevice:
    return MeshDevice(device_id, l1_small_size)


def close_device(device: MeshDevice) -> None:
    device.is_open = False


@attrs.define(eq=False)
class Tensor:
    """A ttnn tensor: TILE storage padded to multiples of 32 with NaN poison, on a device or on the host."""

    _storage: torch.Tensor
    _shape: tuple[int, ...]
    _dtype: DataType
    _layout: Layout
    _device: MeshDevice | None = None
    _memory_config: MemoryConfig = DRAM_MEMORY_CONFIG

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> DataType:
        return self._dtype

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return tuple(self._storage.shape)

    def device(self) -> MeshDevice | None:
        return self._device

    def memory_config(self) -> MemoryConfig:
        return self._memory_config

    def is_sharded(self) -> bool:
        return self._memory_config.sharded


def logical(t: Tensor) -> torch.Tensor:
    """The tensor's values without tile padding."""
    if t.layout is ROW_MAJOR_LAYOUT:
        return t._storage
    h, w = ((1, *t.shape))[-2:]
    return t._storage[..., :h, :w].reshape(t.shape)


def _tile(t: torch.Tensor) -> torch.Tensor:
    """Pad the last two dimensions (a 1-D tensor is one row) to multiples of 32, with NaN poison."""
    v = t if t.dim() >= 2 else t.reshape(1, -1)
    h, w = v.shape[-2:]
    ph, pw = math.ceil(h / TILE) * TILE - h, math.ceil(w / TILE) * TILE - w
    if not (ph or pw):
        return v.clone()
    fill = float("nan") if v.is_floating_point() else -1
    return F.pad(v, (0, pw, 0, ph), value=fill)


def make(
    t: torch.Tensor,
    dtype: DataType,
    layout: Layout,
    device: MeshDevice | None,
    memory_config: MemoryConfig = DRAM_MEMORY_CONFIG,
) -> Tensor:
    t = t.to(dtype.storage)
    storage = _tile(t) if layout is TILE_LAYOUT else t.clone()
    return Tensor(storage, tuple(t.shape), dtype, layout, device, memory_config)


def need(
    t: Any,
    what: str,
    *,
    layout: Layout | None = TILE_LAYOUT,
    dtype: DataType | None = bfloat16,
    sharded_ok: bool = False,
) -> torch.Tensor:
    """`t`'s values as float32, after checking it is a device tensor of `layout` and `dtype` (None: any)."""
    if not isinstance(t, Tensor):
        raise TtnnDoubleError(f"{what}: expected a ttnn.Tensor, got {type(t).__name__}")
    if t._device is None or not t._device.is_open:
        raise TtnnDoubleError(f"{what}: the tensor is not on an open device (from_torch(..., device=device))")
    if layout is not None and t.layout is not layout:
        raise TtnnDoubleError(f"{what}: needs {layout.name} layout, got {t.layout.name}")
    if dtype is not None and t.dtype is not dtype:
        raise TtnnDoubleError(f"{what}: needs {dtype.name}, got {t.dtype.name}")
    if t.is_sharded() and not sharded_ok:
        raise TtnnDoubleError(
            f"{what}: got a sharded tensor (a conv2d or pooling output); this double takes interleaved tensors "
            "only: ttnn.sharded_to_interleaved(x, ttnn.DRAM_MEMORY_CONFIG) first"
        )
    return logical(t).float()


def result(t: torch.Tensor, device: MeshDevice | None, layout: Layout = TILE_LAYOUT) -> Tensor:
    """An op's output: bfloat16 (every device result is rounded), in `layout`."""
    return make(t.to(torch.bfloat16), bfloat16, layout, device)


# -- conversions -------------------------------------------------------------------------------


def from_torch(
    tensor: torch.Tensor | None,
    dtype: DataType | None = None,
    *,
    spec: Any = None,
    tile: Any = None,
    pad_value: float | None = None,
    layout: Layout | None = None,
    device: MeshDevice | None = None,
    memory_config: MemoryConfig | None = None,
    mesh_mapper: Any = None,
    cq_id: int | None = None,
    preserve_nan_values: bool = False,
    col_tilize: bool = False,
    enable_bfloat_opt: bool = False,
) -> Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TtnnDoubleError(f"from_torch: expected a torch.Tensor, got {type(tensor).__name__}")
    dtype = dtype or (bfloat16 if tensor.dtype == torch.bfloat16 else float32)
    if dtype is uint32 and (tensor.is_floating_point() or bool((tensor < 0).any())):
        raise TtnnDoubleError("from_torch: uint32 needs non-negative integer values")
    if not 1 <= tensor.dim() <= 4:
        raise TtnnDoubleError(f"from_torch: rank {tensor.dim()}; this double takes rank 1 to 4")
    return make(tensor, dtype, layout or ROW_MAJOR_LAYOUT, device, memory_config or DRAM_MEMORY_CONFIG)


def to_torch(
    tensor: Tensor,
    dtype: torch.dtype | None = None,
    *,
    torch_rank: int | None = None,
    mesh_composer: Any = None,
    device: MeshDevice | None = None,
    cq_id: int | None = None,
) -> torch.Tensor:
    if not isinstance(tensor, Tensor):
        raise TtnnDoubleError(f"to_torch: expected a ttnn.Tensor, got {type(tensor).__name__}")
    out = logical(tensor).clone()
    return out if dtype is None else out.to(dtype)


def to_layout(
    tensor: Tensor,
    layout: Layout,
    dtype: DataType | None = None,
    memory_config: MemoryConfig | None = None,
    sub_core_grids: Any = None,
) -> Tensor:
    data = need(tensor, "to_layout", layout=None, dtype=None)
    return make(data.to(tensor.dtype.storage), dtype or tensor.dtype, layout, tensor.device())


def sharded_to_interleaved(
    input_tensor: Tensor, memory_config: MemoryConfig | None = None, output_dtype: DataType | None = None
) -> Tensor:
    data = need(input_tensor, "sharded_to_interleaved", layout=None, dtype=None, sharded_ok=True)
    if not input_tensor.is_sharded():
        raise TtnnDoubleError("sharded_to_interleaved: the input is not sharded")
    if memory_config is not None and memory_config.sharded:
        raise TtnnDoubleError("sharded_to_interleaved: memory_config must be interleaved")
    out = make(data.to(input_tensor.dtype.storage), input_tensor.dtype, input_tensor.layout, input_tensor.device())
    return attrs.evolve(out, memory_config=memory_config or DRAM_MEMORY_CONFIG)


def sizes(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(s) for s in shape)


# -- factories ---------------------------------------------------------------------------------------------


def arange(
    start: int,
    end: int,
    step: int = 1,
    *,
    dtype: DataType = bfloat16,
    device: MeshDevice | None = None,
    memory_config: MemoryConfig = DRAM_MEMORY_CONFIG,
    layout: Layout = ROW_MAJOR_LAYOUT,
) -> Tensor:
    return make(torch.arange(start, end, step).to(torch.bfloat16), dtype, layout, device, memory_config)


def full(
    shape: Sequence[int],
    fill_value: float,
    dtype: DataType | None = None,
    layout: Layout | None = None,
    device: MeshDevice | None = None,
    memory_config: MemoryConfig | None = None,
    optional_tensor: Tensor | None = None,
) -> Tensor:
    data = torch.full(sizes(shape), float(fill_value)).to(torch.bfloat16)
    return make(data, dtype or bfloat16, layout or ROW_MAJOR_LAYOUT, device, memory_config or DRAM_MEMORY_CONFIG)
