"""A call on a CPU device with torch tensors in and out, and nothing between them that the call does not need.

`calling.Invoker` goes through numpy: each argument's tensor to an array (`host_array`), the array's flags and
address read to decide its import, each result mapped to an array, then made a tensor; its checks are generic
(numbers, dtypes, unmappable buffers). Right after the module's run, with the caches holding the module's data, each
of those steps costs 10-35 us, not its ~2 us in a warm loop: a 1x1 convolution of ResNet-50 (0.86 ms in the module)
paid ~0.21 ms of them a call (docs/performance.md "The call's own steps, cold"). `HostCall` takes the same decisions
from torch's side in fewer steps: an argument is imported where `Plan.unwritten` says so and the tensor is contiguous
and 64-byte aligned (`Tensor.data_ptr`), else copied (a tensor that requires grad, or of another device, through
`host_array`); a result becomes a tensor over IREE's mapped buffer by `torch.frombuffer` (which keeps the mapping,
and so the buffer, alive), copied unless `Plan.fresh` or where it overlaps an imported input or another result. CPU
devices live as long as the process (`runtime.get_device`), so a result need not hold its device. Each result's
element type is checked against the plan's dtype every call (converted where IREE's differs). A plan with a dtype
numpy lacks (bfloat16) is left to `calling.fast_call`.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from fx_rewrites.backends.convention import Plan
from fx_rewrites.backends.iree.calling import (
    _ALIGNMENT,
    CHECK_ENV,
    MISS,
    _check_unchanged,
    fits,
    host_array,
    input_checks,
    to_torch,
)

#: the dtypes a call takes this way: numpy's own (torch.frombuffer and Tensor.numpy take them); others go `Invoker`'s
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


class HostCall:
    """`plan`'s call of an iree.runtime `FunctionInvoker` on a CPU device for positional tensors that `fits`;
    `MISS` for any other call (the general path then binds it and names a mismatch). Built by `of`."""

    def __init__(self, plan: Plan, function: Any, checks: tuple[Any, ...]) -> None:
        import iree.runtime as rt
        from iree.runtime.array_interop import map_dtype_to_element_type

        def element(dtype: torch.dtype) -> int:
            return int(map_dtype_to_element_type(torch.empty((), dtype=dtype).numpy().dtype))

        self._checks = checks
        self._context, self._function = function._vm_context, function._vm_function
        self._device = function._device
        self._allocator = function._device.allocator
        self._list, self._ref, self._view = rt.VmVariantList, rt.VmRef, rt.HalBufferView
        self._raw_dtype = rt.HalElementType.map_to_dtype
        self._imported_memory = int(rt.MemoryType.DEVICE_LOCAL | rt.MemoryType.HOST_VISIBLE)
        self._imported_usage = int(rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING)
        self._copied_memory, self._copied_usage = int(rt.MemoryType.DEVICE_LOCAL), int(rt.BufferUsage.DEFAULT)
        unwritten = plan.unwritten or (False,) * len(plan.args)
        #: per argument of the function: the position of its tensor in the call, imported or not, its element type
        self._inputs = tuple(
            (a, bool(u), element(plan.inputs[a].dtype)) for a, u in zip(plan.args, unwritten, strict=True)
        )
        count = 1 + max((out.result for out in plan.outputs if out.result is not None), default=-1)
        fresh = plan.fresh or (False,) * count
        dtypes: list[torch.dtype | None] = [None] * count
        for out in plan.outputs:
            if out.result is not None:
                dtypes[out.result] = out.dtype
        #: per result: None where no output reads it, else (dtype, element type, handed out uncopied)
        self._results = tuple(
            None if dtype is None else (dtype, element(dtype), bool(fresh[i]) if i < len(fresh) else False)
            for i, dtype in enumerate(dtypes)
        )
        self._outputs = tuple((out.result, out.constant) for out in plan.outputs)
        self._spec = plan.out_spec
        self._single = plan.out_spec.is_leaf() and len(plan.outputs) == 1
        self._check = os.environ.get(CHECK_ENV) == "1"

    @classmethod
    def of(cls, plan: Plan, function: Any) -> HostCall | None:
        """None where the plan or the function is not of the form this takes (mutations, host state, keyword or
        non-tensor inputs, a dtype outside `_DTYPES`, a function of another iree.runtime's form)."""
        checks = input_checks(plan)
        if checks is None or any(out.write is not None for out in plan.outputs):
            return None
        if any(item.dtype not in _DTYPES for item in plan.inputs):
            return None
        if any(out.result is not None and out.dtype not in _DTYPES for out in plan.outputs):
            return None
        try:
            import iree.runtime as rt

            if not isinstance(function, rt.FunctionInvoker) or function._has_inlined_results:
                return None
            return cls(plan, function, checks)
        except (AttributeError, KeyError, TypeError, ValueError, ImportError):
            return None

    def __call__(self, args: tuple[Any, ...]) -> Any:
        if not fits(self._checks, args):
            return MISS
        arguments, imported, kept = self._list(len(self._inputs)), [], []
        for position, unwritten, element_type in self._inputs:
            tensor = args[position]
            try:
                array = tensor.numpy()
                aligned = tensor.is_contiguous() and array.nbytes and not tensor.data_ptr() % _ALIGNMENT
            except (RuntimeError, TypeError):  # requires grad, another device, a conjugate or negative view
                array, aligned = host_array(tensor), False
            if unwritten and aligned:
                buffer = self._allocator.import_host_allocation(array, self._imported_memory, self._imported_usage)
                arguments.push_ref(self._view(buffer, array.shape, element_type))
                imported.append(tensor)
                if self._check:
                    kept.append((position, array, array.copy()))
            else:
                array = array if array.flags.c_contiguous else np.array(array, order="C")  # a 0-d stays 0-d
                arguments.push_ref(
                    self._allocator.allocate_buffer_copy(
                        self._copied_memory, self._copied_usage, self._device, array, element_type
                    )
                )
        results = self._list(len(self._results))
        self._context.invoke(self._function, arguments, results)
        if kept:
            _check_unchanged({p: array for p, array, _ in kept}, [(p, before) for p, _, before in kept])
        tensors = [self._result(results, i) for i in range(len(self._results))]
        # a result handed out shares memory with nothing else the caller sees
        for i, wanted in enumerate(self._results):
            if wanted is not None and wanted[2] and isinstance(tensors[i], torch.Tensor):
                others = imported + [t for j, t in enumerate(tensors) if j != i and isinstance(t, torch.Tensor)]
                if _overlaps(tensors[i], others):
                    tensors[i] = tensors[i].clone()
        values = [constant if result is None else tensors[result] for result, constant in self._outputs]
        if self._single:
            return values[0]
        from torch.utils import _pytree as pytree

        return pytree.tree_unflatten(values, self._spec)

    def _result(self, results: Any, i: int) -> Any:
        """Result `i` as the plan's tensor: over IREE's buffer where it is fresh (`__call__` copies it where it
        overlaps another), else a copy; a number as it is; None where no output reads it."""
        wanted = self._results[i]
        if wanted is None:
            return None
        dtype, element_type, fresh = wanted
        value = results.get_variant(i)
        if not isinstance(value, self._ref):
            return value  # a number (a size the program returns)
        view = value.deref(self._view, True)
        if view.element_type != element_type:  # IREE's type for it is not the plan's (a bool as i8): converted
            array = view.map().asarray(view.shape, self._raw_dtype(view.element_type))
            return to_torch(array.copy(), dtype)
        shape = view.shape
        count = math.prod(shape)
        if not count:
            return torch.empty(shape, dtype=dtype)
        # the mapping spans the whole buffer, which IREE may allocate larger than the view (6 floats in 64 bytes)
        tensor = torch.frombuffer(view.map(), dtype=dtype, count=count).view(shape)
        return tensor if fresh else tensor.clone()


def _overlaps(tensor: torch.Tensor, others: list[torch.Tensor]) -> bool:
    """Whether `tensor`'s bytes overlap any of `others`' (a result IREE made a view of an input or of another)."""
    start = tensor.data_ptr()
    end = start + tensor.nbytes
    for other in others:
        begin = other.data_ptr()
        if begin < end and start < begin + other.nbytes:
            return True
    return False


__all__ = ["HostCall"]
