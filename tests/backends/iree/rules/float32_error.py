"""The rules' numeric check: as near float64 as torch's own float32, within a step."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence

import torch


def in_float64(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module` that runs a float64 input in float64 (a copy of it in float64: the reference
    `assert_within_torch_error` compares with) and any other input as it is."""
    wide = copy.deepcopy(module).double()
    return lambda x: (wide if x.dtype == torch.float64 else module)(x)


def redrawn(args: Sequence[torch.Tensor], seed: int) -> tuple[torch.Tensor, ...]:
    """`args` drawn again: each floating tensor of more than one value replaced by a seeded normal draw of its shape,
    its mean and standard deviation (the others, positions and masks, kept)."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(a.shape, generator=generator, dtype=a.dtype) * a.std() + a.mean()
        if a.is_floating_point() and a.numel() > 1
        else a
        for a in args
    )


def assert_within_torch_error(
    got_of: Callable,
    module: Callable,
    inputs: Iterable[Sequence[torch.Tensor]],
    torch_forms: Sequence[Callable] = (),
    *,
    exact_of: Callable | None = None,
    redraws: int = 0,
) -> None:
    """On each input set, `got_of(*args)` is as near a float64 run of `module` as eager float32 is, within a step.
    `torch_forms`: other float32 runs of the same computation by torch's own kernels (a convolution through its
    native im2col + GEMM as well as oneDNN): torch's float32 error is the largest of them and `module`'s.
    `exact_of`: the float64 reference where `module` cannot run in float64 (a quantized model's own values).

    `redraws`: torch's error is also measured on that many redraws of each input set (`redrawn`), run by torch
    alone, and is the largest of all. One draw's error is a sample: a kernel that sums in another order than torch's
    is above torch's on about half the draws at the same root-mean-square error (the int4 matvec dispatch: 14-20 of
    40 draws, its RMS 0.89-0.92 of torch's on an AVX-512 Xeon), so its check is against the largest torch makes at
    these shapes, not against one draw's luck."""
    exact_of = exact_of or (lambda *args: module(*(a.double() if a.is_floating_point() else a for a in args)))

    def torch_error(args: Sequence[torch.Tensor]) -> float:
        exact = exact_of(*args)
        return max((form(*args).double() - exact).abs().max().item() for form in (module, *torch_forms))

    for number, args in enumerate(inputs):
        exact = exact_of(*args)
        with torch.no_grad():
            error_of_torch = max(
                [torch_error(args)] + [torch_error(redrawn(args, 1000 * number + d)) for d in range(redraws)]
            )
            got = got_of(*args)
        step = torch.finfo(torch.float32).eps * exact.abs().max().item()
        error = (got.double() - exact).abs().max().item()
        assert error <= error_of_torch + step, (error, error_of_torch, step)
