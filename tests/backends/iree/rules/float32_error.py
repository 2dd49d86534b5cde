"""The rules' numeric check: as near float64 as torch's own float32, within a step."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch


def assert_within_torch_error(
    got_of: Callable,
    module: Callable,
    inputs: Iterable[Sequence[torch.Tensor]],
    torch_forms: Sequence[Callable] = (),
) -> None:
    """On each input set, `got_of(*args)` is as near a float64 run of `module` as eager float32 is, within a step.
    `torch_forms`: other float32 runs of the same computation by torch's own kernels (a convolution through its
    native im2col + GEMM as well as oneDNN): torch's float32 error is the largest of them and `module`'s."""
    for args in inputs:
        exact = module(*(a.double() if a.is_floating_point() else a for a in args))
        torch_error = max((form(*args).double() - exact).abs().max().item() for form in (module, *torch_forms))
        step = torch.finfo(torch.float32).eps * exact.abs().max().item()
        error = (got_of(*args).double() - exact).abs().max().item()
        assert error <= torch_error + step, (error, torch_error, step)
