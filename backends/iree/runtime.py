"""Calling a compiled module: the call plan, torch <-> host arrays, and `IreeCompiled`."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree


@attrs.frozen(eq=False)
class Output:
    """One output: where its value comes from and where it goes."""

    #: index among the compiled function's results; None for a constant output
    result: int | None
    constant: Any = None
    dtype: torch.dtype | None = None
    #: a mutation's destination: a flat user-input index or a state tensor; None for a user output
    write: int | torch.Tensor | None = None


@attrs.frozen(eq=False)
class Plan:
    """How a call maps onto the compiled function and back."""

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    #: per argument of the compiled function: a flat input index, or a (mutated) state tensor
    args: tuple[int | torch.Tensor, ...]
    outputs: tuple[Output, ...]


def to_host(value: Any) -> Any:
    """What the IREE runtime takes for `value`: a numpy array for a tensor, a Python number as is."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return value


def from_device(value: Any, dtype: torch.dtype | None) -> Any:
    """A torch tensor (of `dtype`, when given) for one result of the compiled function."""
    import numpy as np

    array = value.to_host() if hasattr(value, "to_host") else value
    if not isinstance(array, np.ndarray):
        return array  # a scalar result (SymInt output)
    array = np.array(array, copy=True)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    t = torch.from_numpy(array)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)  # the dtype the graph promised


@attrs.define(eq=False)
class IreeCompiled:
    """A compiled program: call it like `program.module()` (or the GraphModule it was compiled from).

    `mlir` is the imported module text, `key` its cache key, `vmfb` the
    compiled bytes and `from_cache` whether they came from the cache.
    """

    plan: Plan = attrs.field(repr=False)
    function: Any = attrs.field(repr=False)
    mlir: str = attrs.field(repr=False)
    vmfb: bytes = attrs.field(repr=False)
    key: str = ""
    from_cache: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan = self.plan
        if kwargs and plan.in_spec.num_children == 2:  # in the order export saw them
            wanted = plan.in_spec.child(1).context or []
            if set(kwargs) == set(wanted):
                kwargs = {k: kwargs[k] for k in wanted}
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != plan.in_spec:
            raise TypeError(
                f"the compiled program takes (args, kwargs) shaped {pytree.treespec_pprint(plan.in_spec)}, "
                f"got {pytree.treespec_pprint(spec)}"
            )
        results = self.function(*(to_host(flat[a] if isinstance(a, int) else a) for a in plan.args))
        if not isinstance(results, (tuple, list)):
            results = (results,)
        user_outputs = []
        for out in plan.outputs:
            value = out.constant if out.result is None else from_device(results[out.result], out.dtype)
            if out.write is None:
                user_outputs.append(value)
                continue
            with torch.no_grad():  # mutations land where program.module() puts them
                (flat[out.write] if isinstance(out.write, int) else out.write).copy_(value)
        return pytree.tree_unflatten(user_outputs, plan.out_spec)
