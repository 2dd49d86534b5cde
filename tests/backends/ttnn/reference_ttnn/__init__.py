"""TEST DOUBLE of the `ttnn` module: NOT ttnn, only its contract as the lowering uses it.

It implements, in torch, exactly the ttnn functions `backends/ttnn/dispatch.py`
calls, with ttnn 0.81.1's signatures (parameter names and kinds; no `**kwargs`
catch-all, so a misspelt keyword fails as on ttnn; `tools/ttnn_check` checks
them against the real package) and its documented constraints, so that a wrong
argument, a wrong layout or a forgotten conversion fails a test without hardware:

- device tensors hold bfloat16 (or uint32 indices); every op result is
  rounded to bfloat16;
- TILE_LAYOUT storage is padded to multiples of 32 in the last two
  dimensions, and the padding is poisoned with NaN: a value that reaches the
  host without `to_torch` unpadding it, or an op that reads padding, shows;
- compute ops want device tensors in TILE_LAYOUT; embedding wants uint32
  row-major indices and a row-major table, and a TILE output only for widths
  that are multiples of 32; conv2d wants NHWC input and host row-major weights;
  max_pool2d wants a [1, 1, N*H*W, C] row-major input and returns row-major;
- `ttnn.pad` on a TILE tensor refuses front padding; attention takes a mask of
  shape [b or 1, heads or 1, s_q, s_k] and refuses one with `is_causal=True`;
  `ttnn.linear`'s bias is a row vector `[1, N]`;
- conv2d and pooling need `open_device(..., l1_small_size=...)` (ttnn's default
  0 fails with an L1_SMALL out-of-memory error) and leave their output sharded,
  which other ops refuse until `sharded_to_interleaved`.

Written independently of the stand-ins' own torch bodies
(`backends/ttnn/rules/ops.py`): the tests compare the two paths with eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.backends.ttnn.reference_ttnn._core import (
    DEFAULT_L1_SMALL_SIZE,
    DRAM_MEMORY_CONFIG,
    IS_TEST_DOUBLE,
    L1_MEMORY_CONFIG,
    ROW_MAJOR_LAYOUT,
    TILE,
    TILE_LAYOUT,
    DataType,
    Layout,
    MemoryConfig,
    MeshDevice,
    Tensor,
    TtnnDoubleError,
    arange,
    bfloat16,
    close_device,
    float32,
    from_torch,
    full,
    int32,
    logical,
    open_device,
    sharded_to_interleaved,
    to_layout,
    to_torch,
    uint32,
)
from tests.backends.ttnn.reference_ttnn._eltwise import (
    addcdiv,
    addcmul,
    binary,
    clamp,
    cumsum,
    elu,
    leaky_relu,
    pow,
    reduction,
    tril,
    unary,
    where,
)
from tests.backends.ttnn.reference_ttnn._movement import (
    concat,
    expand,
    pad,
    permute,
    repeat,
    reshape,
    roll,
    slice,
    stack,
    transpose,
)
from tests.backends.ttnn.reference_ttnn._nn import (
    avg_pool2d,
    batch_norm,
    conv2d,
    embedding,
    layer_norm,
    linear,
    matmul,
    max_pool2d,
    softmax,
    transformer,
)

relu = unary("relu", torch.relu)
gelu = unary("gelu", F.gelu)
silu = unary("silu", F.silu)
sigmoid = unary("sigmoid", torch.sigmoid)
tanh = unary("tanh", torch.tanh)
exp = unary("exp", torch.exp)
log = unary("log", torch.log)
sqrt = unary("sqrt", torch.sqrt)
rsqrt = unary("rsqrt", torch.rsqrt)
neg = unary("neg", torch.neg)
abs = unary("abs", torch.abs)
reciprocal = unary("reciprocal", torch.reciprocal)
erf = unary("erf", torch.erf)
sin = unary("sin", torch.sin)
cos = unary("cos", torch.cos)
acos = unary("acos", torch.acos)
asin = unary("asin", torch.asin)
atan = unary("atan", torch.atan)
acosh = unary("acosh", torch.acosh)
asinh = unary("asinh", torch.asinh)
atanh = unary("atanh", torch.atanh)
expm1 = unary("expm1", torch.expm1)
log1p = unary("log1p", torch.log1p)
log2 = unary("log2", torch.log2)
log10 = unary("log10", torch.log10)
hardsigmoid = unary("hardsigmoid", F.hardsigmoid)
hardswish = unary("hardswish", F.hardswish)
logical_not = unary("logical_not", torch.logical_not)

add = binary("add", torch.add)
subtract = binary("subtract", torch.sub)
multiply = binary("multiply", torch.mul)
divide = binary("divide", torch.div)
maximum = binary("maximum", torch.maximum)
minimum = binary("minimum", torch.minimum)
gt = binary("gt", torch.gt)
lt = binary("lt", torch.lt)
ge = binary("ge", torch.ge)
le = binary("le", torch.le)
eq = binary("eq", torch.eq)
ne = binary("ne", torch.ne)

sum = reduction("sum", torch.sum)
mean = reduction("mean", torch.mean)
max = reduction("max", torch.amax)
min = reduction("min", torch.amin)

__all__ = [
    "DEFAULT_L1_SMALL_SIZE",
    "DRAM_MEMORY_CONFIG",
    "IS_TEST_DOUBLE",
    "L1_MEMORY_CONFIG",
    "ROW_MAJOR_LAYOUT",
    "TILE",
    "TILE_LAYOUT",
    "DataType",
    "Layout",
    "MemoryConfig",
    "MeshDevice",
    "Tensor",
    "TtnnDoubleError",
    "addcdiv",
    "addcmul",
    "arange",
    "avg_pool2d",
    "batch_norm",
    "bfloat16",
    "clamp",
    "close_device",
    "concat",
    "conv2d",
    "cumsum",
    "elu",
    "embedding",
    "expand",
    "float32",
    "from_torch",
    "full",
    "int32",
    "layer_norm",
    "leaky_relu",
    "linear",
    "logical",
    "matmul",
    "max_pool2d",
    "open_device",
    "pad",
    "permute",
    "pow",
    "repeat",
    "reshape",
    "roll",
    "sharded_to_interleaved",
    "slice",
    "softmax",
    "stack",
    "to_layout",
    "to_torch",
    "transformer",
    "transpose",
    "tril",
    "uint32",
    "where",
]
