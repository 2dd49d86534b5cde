"""The per-call path of a compiled function: the plan's checks built once, the module function invoked directly.

A call of `IreeCompiled` used to pay, on top of the module's own run, the full
`convention.bind` (pytree flattening and the checks that name a mismatch: ~14
us in Python), iree.runtime's `FunctionInvoker` (~3 us of Python around the
invoke) and a `DeviceArray` per result (~5 us to map and copy it). For the
common call, positional tensors of the compiled dtypes and sizes, `fits`
checks the same conditions as `bind` (dtype, rank, every static size, each
Dim's range and divisor, sizes of one symbol agreeing) without building messages, and
`Invoker` packs the arguments, invokes the function and copies each result out
of its mapped buffer; any other call (keyword arguments, a structure, a
mismatch, which `bind` then names) takes the general path. On a CPU device
`host_call.HostCall` takes that call instead (the same decisions from torch's
side, in fewer steps); `Invoker` serves other devices, the dtypes it does not take (bfloat16) and the
unchecked calls.

On a CPU device an input the program never writes (`Plan.unwritten`: `sharing.unwritten_arguments` proves it
from the graph) is imported as the device buffer the module reads (`HalAllocator.import_host_allocation`: no copy;
the call returns after the module has run) where it is C-contiguous, writable and 64-byte aligned (what IREE's
kernels assume of a binding); every other input is copied into a new device buffer, as iree.runtime's packer does.
IREE 3.13 writes in place into an imported argument that a scatter or a sort updates (docs/iree-3.13-findings.md,
71): hence the proof. With `FX_REWRITES_CHECK_INPUTS=1` (the test suite) each imported input is compared, bit for
bit, with a copy taken before the call, and a difference raises `InputWrittenError`. A copy costs ~0.25 ms of a 1x1
convolution's 3.2 MB input.

A result is copied out of IREE's buffer unless the plan says it is the call's own (`Plan.fresh`: computed by a
product, a convolution or a dispatch of ours, `sharing.fresh_results`) and its memory overlaps no other result's
and no argument's: then the array over IREE's mapped buffer is handed out (it keeps the buffer alive; IREE reuses
it once the array is gone). Any other result may be a buffer the module keeps (a constant, a global of its state, a
weight served from the model's own memory, an imported input), which a later call or a write through the tensor
would change. A copy costs ~26 us for 512 KB and ~0.3 ms for 3.2 MB (one core's memory bandwidth, with the copy
into a new array) on the hosts of docs/performance.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fx_rewrites.backends.convention import Plan, positional_leaves, size_form

#: one input's check: (dtype, rank, the static sizes as (dim, size), the dynamic ones as (dim, symbol, low, high,
#: scale, offset): `convention.size_form`'s key and form)
_Dynamic = tuple[int, str, int, float, int, int]
_InputCheck = tuple[torch.dtype, int, tuple[tuple[int, int], ...], tuple[_Dynamic, ...]]


def input_checks(plan: Plan) -> tuple[_InputCheck, ...] | None:
    """What `fits` checks per positional argument of `plan`, or None where calls must take `bind`: a plan
    with keyword arguments, structures, constants, numbers or unchecked inputs, or state passed by the host."""
    count = positional_leaves(plan.in_spec)
    if count is None or not plan.inputs or len(plan.inputs) != count:
        return None
    if any(not isinstance(a, int) for a in plan.args):
        return None
    checks = []
    for item in plan.inputs:
        if item.kind != "tensor" or not isinstance(item.dtype, torch.dtype):
            return None
        static = tuple((d, n) for d, n in enumerate(item.shape) if isinstance(n, int))
        dynamic = []
        for d, symbol in enumerate(item.shape):
            if not isinstance(symbol, int):
                low, high = plan.ranges.get(symbol, (0, None))
                key, scale, offset = size_form(symbol)
                dynamic.append((d, key, low, float("inf") if high is None else high, scale, offset))
        checks.append((item.dtype, len(item.shape), static, tuple(dynamic)))
    return tuple(checks)


def fits(checks: tuple[_InputCheck, ...], args: tuple[Any, ...]) -> bool:
    """Whether positional `args` pass `bind`'s checks (built by `input_checks`); False: let `bind` name why."""
    if len(args) != len(checks):
        return False
    sizes: dict[str, int] = {}
    for value, (dtype, rank, static, dynamic) in zip(args, checks):
        if not isinstance(value, torch.Tensor) or value.dtype is not dtype:
            return False
        shape = value.shape
        if len(shape) != rank:
            return False
        for d, n in static:
            if shape[d] != n:
                return False
        for d, key, low, high, scale, offset in dynamic:
            got = shape[d]
            if got < low or got > high or (got - offset) % scale:
                return False
            value = (got - offset) // scale
            if sizes.setdefault(key, value) != value:
                return False
    return True


def host_array(value: torch.Tensor) -> Any:
    """A CPU tensor's memory as the numpy array the IREE runtime takes (bfloat16 as ml_dtypes' bfloat16)."""
    t = value.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(array: np.ndarray, dtype: torch.dtype | None) -> torch.Tensor:
    """A torch tensor over `array` (which the caller owns: a copy), of `dtype` when given."""
    if array.dtype.kind == "V" or array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    t = torch.from_numpy(array)
    return t if dtype is None or t.dtype is dtype else t.to(dtype)  # the dtype the graph promised


class Invoker:
    """Calls an iree.runtime `FunctionInvoker`'s function with its own argument packer and copies each result out
    of its mapped buffer (a number as is): what the invoker and a `DeviceArray` do, less their Python. Built by
    `of`; None where the function is not of the form this knows (another IREE version: the invoker is used)."""

    def __init__(
        self,
        function: Any,
        dtypes: Sequence[np.dtype] | None,
        unwritten: Sequence[bool] = (),
        fresh: Sequence[bool] = (),
    ) -> None:
        import iree.runtime as rt
        from iree.runtime.array_interop import map_dtype_to_element_type

        self._context = function._vm_context
        self._function = function._vm_function
        self._device = function._device
        self._packer = function._arg_packer
        #: per result, the dtype its reflection gives (None: the module carries none, as the FX importer's)
        self._dtypes = None if dtypes is None else tuple(dtypes)
        self._invoke_context = rt._binding.InvokeContext
        self._list = rt.VmVariantList
        self._ref = rt.VmRef
        self._buffer_view = rt.HalBufferView
        self._raw_dtype = rt.HalElementType.map_to_dtype
        self._visible, self._mapping = int(rt.MemoryType.HOST_VISIBLE), int(rt.BufferUsage.MAPPING_SCOPED)
        self._slow = function  # for a result that is not host-mappable (a GPU's device-local memory)
        #: per argument, whether it is imported in place (a CPU device and `Plan.unwritten`); empty: none is
        self._unwritten = tuple(unwritten) if any(unwritten) else ()
        self._allocator = function._device.allocator if self._unwritten else None
        self._element_type = map_dtype_to_element_type
        self._imported_memory = int(rt.MemoryType.DEVICE_LOCAL | rt.MemoryType.HOST_VISIBLE)
        self._imported_usage = int(rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING)
        self._copied_memory, self._copied_usage = int(rt.MemoryType.DEVICE_LOCAL), int(rt.BufferUsage.DEFAULT)
        self._check = os.environ.get(CHECK_ENV) == "1"
        #: per result, whether it may be handed out as IREE's buffer (`Plan.fresh`); empty: each is copied
        self._fresh = tuple(fresh) if any(fresh) else ()

    @classmethod
    def of(cls, function: Any, unwritten: Sequence[bool] = (), fresh: Sequence[bool] = ()) -> Invoker | None:
        """`unwritten`: per argument, True where the module never writes it (`Plan.unwritten`) and `function`'s
        device is a CPU device (`runtime.is_host_device`): those arguments are imported, not copied. `fresh`: per
        result, True where it is the call's own buffer (`Plan.fresh`): handed out, not copied."""
        try:
            import iree.runtime as rt
            from iree.runtime.dtypes import map_abi_type_to_dtype_info

            if not isinstance(function, rt.FunctionInvoker) or function._has_inlined_results:
                return None
            descs = function._ret_descs
            if descs is not None and any(not isinstance(d, list) or d[:1] != ["ndarray"] for d in descs):
                return None
            dtypes = None if descs is None else [np.dtype(map_abi_type_to_dtype_info(d[1]).dtype) for d in descs]
            for name in ("_vm_context", "_vm_function", "_device", "_arg_packer"):
                getattr(function, name)
            rt._binding.InvokeContext  # noqa: B018
            return cls(function, dtypes, unwritten, fresh)
        except (AttributeError, KeyError, TypeError, ImportError):
            return None

    def __call__(self, *arrays: Any) -> list[Any]:
        results = self._invoke(arrays)
        out, mapped = [], []
        for i in range(len(results)):
            array = self._mapped(results, i)
            if array is _UNMAPPABLE:  # a GPU's device-local memory: the DeviceArray path copies it by a transfer
                return [np.array(a.to_host(), copy=True) if hasattr(a, "to_host") else a for a in self._slowly(results)]
            if not isinstance(array, np.ndarray):
                out.append(array)  # a number (a size the program returns)
                continue
            want = array.dtype if self._dtypes is None else self._dtypes[i]
            if array.dtype != want:
                out.append(array.astype(want))  # a copy
            elif self._fresh and self._fresh[i] and array.nbytes and array.dtype.kind in "biuf":  # numpy's own
                out.append(array)  # over IREE's buffer (the device lives on: `runtime.get_device`): reused once it dies
                mapped.append(i)
            else:
                out.append(array.copy())
        if mapped:
            self._copy_shared(out, mapped, arrays)
        return out

    @staticmethod
    def _copy_shared(out: list[Any], mapped: list[int], arrays: tuple[Any, ...]) -> None:
        """Copy each result in `mapped` whose memory overlaps another result's or an argument's (a result IREE made
        a view of another, or of an imported input): what the caller gets never shares memory it did not see."""
        own = {i: _span(out[i]) for i in mapped}
        spans = [_span(a) for a in arrays if isinstance(a, np.ndarray) and a.nbytes] + list(own.values())
        for i, (start, end) in own.items():
            if sum(s < end and start < e for s, e in spans) > 1:  # itself, and another
                out[i] = out[i].copy()

    def reduced(self, reduce: Callable[[Any], Any], *arrays: Any) -> Any:
        """`reduce(first result)` with the first result read in place from IREE's mapped buffer, not copied out
        (greedy search's argmax over a step's logits). `reduce` must not keep the array or a view of it: the
        buffer is IREE's, unmapped and reused after the call. A result that is not host-mappable is copied out
        first, as `__call__` does; one of another dtype than its reflection's is converted (a copy)."""
        results = self._invoke(arrays)
        array = self._mapped(results, 0)
        if array is _UNMAPPABLE:
            first = self._slowly(results)[0]
            array = np.array(first.to_host(), copy=True) if hasattr(first, "to_host") else first
        elif isinstance(array, np.ndarray) and self._dtypes is not None and array.dtype != self._dtypes[0]:
            array = array.astype(self._dtypes[0])
        return reduce(array)

    def _invoke(self, arrays: tuple[Any, ...]) -> Any:
        imported = self._imported(arrays) if self._unwritten else None
        if imported is None:
            args = self._packer.pack(self._invoke_context(self._device), arrays, {})
        else:
            args, kept = imported
        results = self._list(1 if self._dtypes is None else len(self._dtypes))
        self._context.invoke(self._function, args, results)
        if imported is not None and self._check:
            _check_unchanged(arrays, kept)
        return results

    def _imported(self, arrays: tuple[Any, ...]) -> tuple[Any, list[tuple[int, np.ndarray]]] | None:
        """The arguments with each unwritten array as a buffer over its own memory and the rest copied, and (under
        `FX_REWRITES_CHECK_INPUTS`) a copy of each imported one; None where no array can be imported (then the
        packer copies them all)."""
        if len(arrays) != len(self._unwritten):
            return None
        places = [i for i, (a, u) in enumerate(zip(arrays, self._unwritten)) if u and self._importable(a)]
        if not places:
            return None
        args, kept = self._list(len(arrays)), []
        for i, array in enumerate(arrays):
            if not isinstance(array, np.ndarray):
                return None  # a number: the packer's
            element_type = self._element_type(array.dtype)
            if element_type is None:
                return None  # a dtype only the packer maps (bfloat16's ml_dtypes array): it copies them all
            element_type = int(element_type)
            if i in places:
                buffer = self._allocator.import_host_allocation(array, self._imported_memory, self._imported_usage)
                args.push_ref(self._buffer_view(buffer, array.shape, element_type))
                if self._check:
                    kept.append((i, array.copy()))
            else:
                contiguous = array if array.flags.c_contiguous else np.array(array, order="C")  # a 0-d stays 0-d
                view = self._allocator.allocate_buffer_copy(
                    self._copied_memory, self._copied_usage, self._device, contiguous, element_type
                )
                args.push_ref(view)
        return args, kept

    def _importable(self, array: Any) -> bool:
        if not isinstance(array, np.ndarray) or not array.nbytes or self._element_type(array.dtype) is None:
            return False
        flags = array.flags
        return flags.c_contiguous and flags.writeable and array.ctypes.data % _ALIGNMENT == 0

    def _mapped(self, results: Any, i: int) -> Any:
        """Result `i` as a numpy array over its mapped buffer (valid while the array lives), a number as it is,
        or `_UNMAPPABLE` for a buffer the host cannot map."""
        value = results.get_variant(i)
        view = value.deref(self._buffer_view, True) if isinstance(value, self._ref) else None
        if view is None:
            return value
        buffer = view.get_buffer()
        visible = buffer.memory_type() & self._visible == self._visible
        if not visible or buffer.allowed_usage() & self._mapping != self._mapping:
            return _UNMAPPABLE
        return view.map().asarray(view.shape, self._raw_dtype(view.element_type))

    def _slowly(self, results: Any) -> list[Any]:
        from iree.runtime.function import Invocation, _extract_vm_sequence_to_python

        return _extract_vm_sequence_to_python(Invocation(self._device), results, self._slow._ret_descs)


def fast_call(plan: Plan, function: Any, host_memory: bool = False) -> Callable[[tuple[Any, ...]], Any] | None:
    """`plan`'s call of `function` for positional tensors that `fits` (returns `MISS` for any other call), or
    None where the plan or the function takes only the general path (mutations, host state, keyword inputs).
    `host_memory`: `function`'s device is a CPU device: the plan's unwritten inputs are imported and its fresh
    results handed out (`Invoker`)."""
    checks = input_checks(plan)
    invoker = Invoker.of(function, plan.unwritten, plan.fresh) if host_memory else Invoker.of(function)
    if checks is None or invoker is None or any(out.write is not None for out in plan.outputs):
        return None
    outputs = tuple((out.result, out.constant, out.dtype) for out in plan.outputs)
    spec = plan.out_spec
    single = spec.is_leaf() and len(outputs) == 1
    order = tuple(plan.args)

    def call(args: tuple[Any, ...]) -> Any:
        if not fits(checks, args):
            return MISS
        arrays = invoker(*(host_array(args[i]) for i in order))
        values = [
            constant if result is None else result_to_torch(arrays[result], dtype)
            for result, constant, dtype in outputs
        ]
        if single:
            return values[0]
        from torch.utils import _pytree as pytree

        return pytree.tree_unflatten(values, spec)

    return call


def result_to_torch(value: Any, dtype: torch.dtype | None) -> Any:
    """One result of `Invoker` as torch gives it: an array as a tensor (`to_torch`), a number as it is."""
    return to_torch(value, dtype) if isinstance(value, np.ndarray) else value


def _span(array: np.ndarray) -> tuple[int, int]:
    """The addresses `array`'s bytes occupy, [start, end)."""
    start = array.ctypes.data
    return start, start + array.nbytes


class InputWrittenError(RuntimeError):
    """A compiled function wrote into an input it was handed in place (`FX_REWRITES_CHECK_INPUTS`)."""


def _check_unchanged(arrays: tuple[Any, ...], kept: list[tuple[int, np.ndarray]]) -> None:
    for i, before in kept:
        if arrays[i].tobytes() != before.tobytes():
            raise InputWrittenError(
                f"the compiled function wrote into its argument {i} ({arrays[i].dtype}{list(arrays[i].shape)}), "
                "which `sharing.unwritten_arguments` found no op to write and the call passed uncopied: an op "
                "listed there as reading only writes in IREE. Fix: remove it from `sharing._READERS` (the "
                "argument is then copied) and report the graph"
            )


#: the environment variable that makes a call check its imported inputs unchanged (the test suite sets it)
CHECK_ENV = "FX_REWRITES_CHECK_INPUTS"
#: the alignment IREE's kernels assume of a binding (`hal.interface.binding.subspan ... alignment(64)`); an input
#: array at another address is copied (torch's CPU allocator aligns its blocks to 64 bytes; a view may not be)
_ALIGNMENT = 64
#: what a fast call returns for a call it does not take
MISS = object()
#: `Invoker._mapped` of a result in memory the host cannot map (a GPU's device-local memory)
_UNMAPPABLE = object()


class UncheckedCall:
    """`IreeCompiled.unchecked`'s call through an `Invoker`: tensors in (the compiled dtypes and shapes, the plan's
    order), the one result out as a tensor of `dtype`; `reduced(reduce, *arrays)` takes numpy arrays and returns
    `reduce` of the result read in place (`Invoker.reduced`: greedy search's argmax, no copy of the logits)."""

    def __init__(self, invoker: Invoker, dtype: torch.dtype | None) -> None:
        self.invoker, self.dtype = invoker, dtype

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        return result_to_torch(self.invoker(*(t.contiguous().numpy() for t in tensors))[0], self.dtype)

    def reduced(self, reduce: Callable[[Any], Any], *arrays: Any) -> Any:
        return self.invoker.reduced(reduce, *arrays)
