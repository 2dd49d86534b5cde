"""Random small modules holding the forms the rule packs rewrite, for differential fuzzing.

A `Spec` is data: an input shape, which of its dims are exported dynamic, and a chain of
`Step`s, each a (kind, parameter) pair that maps the running 4-d tensor to the
next. `FuzzNet(spec)` runs the chain; `specs()` is the hypothesis strategy.
Every step keeps the tensor 4-d and float32 and keeps values bounded (no exp,
no division by a value), so eager and the rewritten program can be compared
with a float32 tolerance. A failing example prints as its Spec, which
`FuzzNet(spec)` rebuilds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from tests.fuzz.view_writes import WRITE_PARAMS, write_through_views

#: tolerance for float32 results of short op chains (rules may reassociate, e.g. batch norm to affine)
RTOL, ATOL = 1e-4, 1e-5


@attrs.frozen
class Step:
    kind: str
    param: Any = None

    def __repr__(self) -> str:
        return f"Step({self.kind!r}, {self.param!r})" if self.param is not None else f"Step({self.kind!r})"


@attrs.frozen
class Spec:
    batch: int
    channels: int
    height: int
    width: int
    steps: tuple[Step, ...]
    dynamic: tuple[int, ...] = ()  # dims of the input exported with torch.export.Dim.AUTO
    mutate_input: bool = False  # forward starts with an in-place op on its input
    two_outputs: bool = False
    seed: int = 0  # weights, constants and inputs

    def shape(self, batch: int | None = None) -> tuple[int, int, int, int]:
        return (batch or self.batch, self.channels, self.height, self.width)

    def inputs(self) -> list[tuple[torch.Tensor]]:
        """The example input, then one more, one larger along each dynamic dim."""
        gen = torch.Generator().manual_seed(self.seed)
        other = tuple(s + 1 if i in self.dynamic else s for i, s in enumerate(self.shape()))
        return [(torch.randn(self.shape(), generator=gen),), (torch.randn(other, generator=gen) * 3,)]

    def dynamic_shapes(self) -> Any:
        """Dim.AUTO on the dynamic dims: a dim the module's code fixes (a buffer's channels, a view to
        the example's sizes) is specialised by export instead of failing it; `exported` says which stayed."""
        return ({i: torch.export.Dim.AUTO for i in self.dynamic},) if self.dynamic else None

    def exported(self, program: torch.export.ExportedProgram) -> Spec:
        """This spec with `dynamic` narrowed to the dims still symbolic in `program` (so the second
        input set varies only those)."""
        x = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == "x").meta["val"]
        kept = tuple(i for i in self.dynamic if not isinstance(x.shape[i], int))
        return attrs.evolve(self, dynamic=kept)


# ----------------------------------------------------------------------------- steps

# Each step: fn(net, index, x) -> x. `net` holds the submodules and buffers the
# step made in `setup` (name suffix: the step's index).

Fn = Callable[[torch.nn.Module, int, torch.Tensor, Any], torch.Tensor]
STEPS: dict[str, Fn] = {}
#: kind -> fn(net, index, spec, shape, param) registering what the step needs
SETUP: dict[str, Callable[..., None]] = {}
#: kind -> new (C, H, W) from the old one and the param
RESHAPE: dict[str, Callable[[tuple[int, int, int], Any], tuple[int, int, int]]] = {}


def step(kind: str, setup: Callable[..., None] | None = None, reshape: Callable | None = None):
    def register(fn: Fn) -> Fn:
        STEPS[kind] = fn
        if setup:
            SETUP[kind] = setup
        if reshape:
            RESHAPE[kind] = reshape
        return fn

    return register


# elementwise
step("relu")(lambda net, i, x, p: torch.relu(x))
step("tanh")(lambda net, i, x, p: torch.tanh(x))
step("sigmoid")(lambda net, i, x, p: torch.sigmoid(x))
step("abs_neg")(lambda net, i, x, p: -torch.abs(x))
step("hardswish")(lambda net, i, x, p: F.hardswish(x))
step("gelu")(lambda net, i, x, p: F.gelu(x))
step("leaky_relu")(lambda net, i, x, p: F.leaky_relu(x, p))
step("add_scalar")(lambda net, i, x, p: x + p)
step("mul_scalar")(lambda net, i, x, p: x * p)
step("pow_int")(lambda net, i, x, p: torch.tanh(x) ** p)
step("clamp")(lambda net, i, x, p: torch.clamp(x, -p, p))

# reductions (broadcast back to the 4-d shape)
step("sum_keepdim")(lambda net, i, x, p: x - x.sum(p, keepdim=True) / 8)
step("amax_keepdim")(lambda net, i, x, p: x - x.amax(p, keepdim=True))
step("mean_all")(lambda net, i, x, p: x - x.mean())
step("softmax")(lambda net, i, x, p: torch.softmax(x, p))

# views
step("transpose", reshape=lambda s, p: (s[0], s[2], s[1]))(lambda net, i, x, p: x.transpose(2, 3))
step("permute_contiguous", reshape=lambda s, p: (s[0], s[2], s[1]))(
    lambda net, i, x, p: x.permute(0, 1, 3, 2).contiguous()
)
step("flatten_unflatten")(lambda net, i, x, p: x.flatten(2).unflatten(2, (x.shape[2], x.shape[3])))
step("view_roundtrip")(lambda net, i, x, p: x.contiguous().view(x.shape[0], -1).view(x.shape))
step("slice_rows", reshape=lambda s, p: (s[0], s[1] - 1, s[2]))(lambda net, i, x, p: x[:, :, 1:])
step("narrow_channels")(lambda net, i, x, p: torch.cat([x[:, :1] * 2, x[:, 1:]], dim=1))


# pooling with default strides (kernel 2 halves the spatial dims)
def _halve(s: tuple[int, int, int], p: Any) -> tuple[int, int, int]:
    return (s[0], s[1] // 2, s[2] // 2)


step("max_pool", reshape=_halve)(lambda net, i, x, p: F.max_pool2d(x, 2))
step("avg_pool", reshape=_halve)(lambda net, i, x, p: F.avg_pool2d(x, 2))
step("max_pool_module", setup=lambda net, i, spec, s, p: net.add_module(f"pool{i}", torch.nn.MaxPool2d(2)))(
    lambda net, i, x, p: getattr(net, f"pool{i}")(x)
)
RESHAPE["max_pool_module"] = _halve
step("avg_pool1d_rows")(
    lambda net, i, x, p: F.avg_pool1d(x.flatten(0, 1), 1).view(x.shape)  # kernel 1: stride missing, shape kept
)


# in-place ops, on fresh tensors, through views, and on buffers
def _inplace_add(net, i, x, p):
    y = x * 1
    y.add_(p)
    return y


def _inplace_slice(net, i, x, p):
    y = x.clone()
    y[:, :1].mul_(p)
    return y


def _inplace_relu(net, i, x, p):
    return F.relu(x * 1, inplace=True)


def _buffer_setup(net, i, spec, s, p):
    net.register_buffer(f"buf{i}", torch.zeros(s[0], 1, 1))


def _buffer_add(net, i, x, p):
    buf = getattr(net, f"buf{i}")
    buf.add_(p)
    return x + buf


def _buffer_copy(net, i, x, p):
    buf = getattr(net, f"buf{i}")
    buf.copy_(x.mean((0, 2, 3)).view(-1, 1, 1))
    return x - buf


def _promoting_add(net, i, x, p):
    y = x * 1
    y += torch.full((x.shape[-1],), p, dtype=torch.float64)  # float32 += float64 stays float32
    return y


def _sum_out(net, i, x, p):
    total = torch.empty(0)
    torch.sum(x, p, keepdim=True, out=total)  # an out= overload, resized
    return x - total / 8


step("inplace_add")(_inplace_add)
step("inplace_hardswish")(lambda net, i, x, p: F.hardswish(x * 1, inplace=True))
step("dropout_inplace")(lambda net, i, x, p: F.dropout(x * 1, p, training=False, inplace=True))
step("promoting_add")(_promoting_add)
step("sum_out")(_sum_out)
step("inplace_slice")(_inplace_slice)
step("inplace_relu")(_inplace_relu)
step("buffer_add", setup=_buffer_setup)(_buffer_add)
step("buffer_copy", setup=_buffer_setup)(_buffer_copy)
step("view_write")(write_through_views)  # writes through chains of views, reads of the base and views after


# boolean masks
def _mask_assign(net, i, x, p):
    y = x.clone()
    y[y < 0] = p
    return y


step("mask_sum")(lambda net, i, x, p: x + x[x > p].sum() / 64)
step("masked_select")(lambda net, i, x, p: x - torch.masked_select(x, x > p).sum() / 64)
step("mask_assign")(_mask_assign)
step("mask_rows")(lambda net, i, x, p: x + x[x.sum((1, 2, 3)) > 0].sum(0) / 8)

# constants made in forward
step("tensor_scalar")(lambda net, i, x, p: x + torch.tensor(p))
step("tensor_channels")(
    lambda net, i, x, p: x * torch.tensor([p + k for k in range(x.shape[1])]).view(1, x.shape[1], 1, 1)
)
step("scalar_tensor_mul")(lambda net, i, x, p: x * (torch.tensor(2.0) * p))


# torch.cond
_BRANCHES = {
    "sin_cos": (torch.sin, torch.cos),
    "relu_neg": (torch.relu, torch.neg),
    "mul_add": (lambda x: x * 2, lambda x: x + 1),
}


def _cond_data(net, i, x, p):
    t, f = _BRANCHES[p]
    return torch.cond(x.sum() > 0, lambda x: t(x), lambda x: f(x), (x,))


def _cond_const(net, i, x, p):
    t, f = _BRANCHES["sin_cos"]
    return torch.cond(torch.tensor(p), lambda x: t(x), lambda x: f(x), (x,))


def _cond_shape(net, i, x, p):
    t, f = _BRANCHES["mul_add"]
    return torch.cond(x.shape[0] > p, lambda x: t(x), lambda x: f(x), (x,))


step("cond_data")(_cond_data)
step("cond_const")(_cond_const)
step("cond_shape")(_cond_shape)


# no_grad blocks
def _no_grad_math(net, i, x, p):
    with torch.no_grad():
        x = x * p + 1
    return x


def _no_grad_inplace(net, i, x, p):
    y = x * 2
    with torch.no_grad():
        y.add_(p)
    return y + x


def _no_grad_buffer(net, i, x, p):
    buf = getattr(net, f"buf{i}")
    with torch.no_grad():
        buf.mul_(0.5).add_(x.mean((0, 2, 3)).view(-1, 1, 1), alpha=0.5)
    return x - buf


step("no_grad_math")(_no_grad_math)
step("no_grad_inplace")(_no_grad_inplace)
step("no_grad_buffer", setup=_buffer_setup)(_no_grad_buffer)


# composites and layers
def _bn_setup(net, i, spec, s, p):
    gen = torch.Generator().manual_seed(spec.seed + i)
    bn = torch.nn.BatchNorm2d(s[0])
    bn.running_mean.copy_(torch.randn(s[0], generator=gen))
    bn.running_var.copy_(torch.rand(s[0], generator=gen) + 0.5)
    bn.weight.data.copy_(torch.randn(s[0], generator=gen))
    net.add_module(f"bn{i}", bn)


def _conv_setup(net, i, spec, s, p):
    torch.manual_seed(spec.seed + i)
    net.add_module(f"conv{i}", torch.nn.Conv2d(s[0], s[0], 3, padding=1))


step("batch_norm", setup=_bn_setup)(lambda net, i, x, p: getattr(net, f"bn{i}")(x))
step("dropout_eval")(lambda net, i, x, p: F.dropout(x, p, training=False))
step("rrelu_eval")(lambda net, i, x, p: F.rrelu(x, training=False))
step("conv", setup=_conv_setup)(lambda net, i, x, p: getattr(net, f"conv{i}")(x))

# SymInts in tensor slots (symbolic when the dim is dynamic, plain ints otherwise)
step("mul_batch")(lambda net, i, x, p: x * x.shape[0])
step("add_batch")(lambda net, i, x, p: x + x.shape[0] / p)
step("pow_batch")(lambda net, i, x, p: torch.tanh(x) ** x.shape[0])
step("sub_size_tensor")(lambda net, i, x, p: x - torch.tensor(x.shape[0]) * p)


# ----------------------------------------------------------------------------- the module


class FuzzNet(torch.nn.Module):
    """Runs `spec.steps` on its input; built from data, so a failing Spec rebuilds it."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        shape = spec.shape()[1:]
        for i, s in enumerate(spec.steps):
            if s.kind in SETUP:
                SETUP[s.kind](self, i, spec, shape, s.param)
            shape = RESHAPE.get(s.kind, lambda s, p: s)(shape, s.param)

    def forward(self, x: torch.Tensor) -> Any:
        if self.spec.mutate_input:
            x.mul_(0.5)
        for i, s in enumerate(self.spec.steps):
            x = STEPS[s.kind](self, i, x, s.param)
        return (x, x.sum(1)) if self.spec.two_outputs else x


def fresh(net: FuzzNet) -> FuzzNet:
    """A copy with the buffers as built (a run updates them)."""
    return copy.deepcopy(net)


# ----------------------------------------------------------------------------- the strategy

_SCALAR = st.sampled_from([-1.5, -0.5, 0.25, 0.5, 2.0, 3.0])
_PARAMS: dict[str, st.SearchStrategy] = {
    "leaky_relu": st.sampled_from([0.01, 0.2]),
    "add_scalar": _SCALAR,
    "mul_scalar": _SCALAR,
    "pow_int": st.integers(2, 3),
    "clamp": st.sampled_from([0.5, 1.0]),
    "sum_keepdim": st.integers(1, 3),
    "amax_keepdim": st.integers(1, 3),
    "softmax": st.integers(1, 3),
    "inplace_add": _SCALAR,
    "dropout_inplace": st.sampled_from([0.1, 0.5]),
    "promoting_add": _SCALAR,
    "sum_out": st.integers(1, 3),
    "inplace_slice": _SCALAR,
    "buffer_add": _SCALAR,
    "mask_sum": st.sampled_from([-0.5, 0.0, 0.5]),
    "masked_select": st.sampled_from([-0.5, 0.0, 0.5]),
    "mask_assign": _SCALAR,
    "tensor_scalar": _SCALAR,
    "tensor_channels": _SCALAR,
    "scalar_tensor_mul": _SCALAR,
    "cond_data": st.sampled_from(sorted(_BRANCHES)),
    "cond_const": st.booleans(),
    "cond_shape": st.integers(1, 4),
    "no_grad_math": _SCALAR,
    "no_grad_inplace": _SCALAR,
    "dropout_eval": st.sampled_from([0.1, 0.5]),
    "add_batch": st.sampled_from([2.0, 4.0]),
    "sub_size_tensor": _SCALAR,
    "view_write": WRITE_PARAMS,
}


def _fits(kind: str, shape: tuple[int, int, int]) -> bool:
    c, h, w = shape
    if kind in ("max_pool", "avg_pool", "max_pool_module"):
        return h >= 2 and w >= 2
    if kind == "slice_rows":
        return h >= 2
    if kind == "narrow_channels":
        return c >= 2
    return True


@st.composite
def steps_for(
    draw: st.DrawFn, shape: tuple[int, int, int], max_steps: int, exclude: frozenset[str] = frozenset()
) -> tuple[Step, ...]:
    out = []
    for _ in range(draw(st.integers(1, max_steps))):
        kind = draw(st.sampled_from(sorted(k for k in STEPS if _fits(k, shape) and k not in exclude)))
        param = draw(_PARAMS[kind]) if kind in _PARAMS else None
        out.append(Step(kind, param))
        shape = RESHAPE.get(kind, lambda s, p: s)(shape, param)
    return tuple(out)


@st.composite
def specs(
    draw: st.DrawFn,
    max_steps: int = 5,
    exclude: frozenset[str] = frozenset(),
    require: str | None = None,
    require_params: st.SearchStrategy | None = None,
) -> Spec:
    """Specs of up to `max_steps` steps, none of a kind in `exclude`; with `require` (a kind that keeps
    the shape and needs no setup), one step of that kind inserted at a drawn place, its parameter drawn
    from `require_params` if given."""
    dynamic = tuple(sorted(draw(st.sets(st.integers(0, 3), min_size=1)))) if draw(st.booleans()) else ()
    low = [2 if i in dynamic else 1 for i in range(4)]  # Dim.AUTO specialises a size-1 example
    batch, channels = draw(st.integers(low[0], 4)), draw(st.integers(low[1], 3))
    height, width = draw(st.sampled_from([2, 4, 6])), draw(st.sampled_from([4, 6]))
    steps = draw(steps_for((channels, height, width), max_steps, exclude))
    if require is not None:
        at = draw(st.integers(0, len(steps)))
        params = require_params if require_params is not None else _PARAMS.get(require)
        param = draw(params) if params is not None else None
        steps = (*steps[:at], Step(require, param), *steps[at:])
    if any(s.kind in SETUP for s in steps):  # buffers, batch norm and conv are built for the example's channels
        dynamic = tuple(d for d in dynamic if d != 1)
    return Spec(
        batch=batch,
        channels=channels,
        height=height,
        width=width,
        steps=steps,
        dynamic=dynamic,
        mutate_input=draw(st.booleans()),
        two_outputs=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
