"""The hand-written dispatches the IREE backend splices into torch-mlir's import (`spliced.py` does the splicing)."""

from __future__ import annotations

from fx_rewrites.backends.iree import (
    a8int4_dispatch,
    f32_dispatch,
    flash_attention_dispatch,
    grouped_conv_dispatch,
    grouped_experts_dispatch,
    int4_dispatch,
    packed_experts,
    pointwise_conv_dispatch,
    tap_conv_dispatch,
    tap_phase_dispatch,
)

#: the kernel modules: each has `MARKS` (its ops' names in torch-mlir's import) and `splice`
KERNELS = (
    int4_dispatch,
    a8int4_dispatch,
    f32_dispatch,
    flash_attention_dispatch,
    grouped_conv_dispatch,
    grouped_experts_dispatch,
    packed_experts,
    pointwise_conv_dispatch,
    tap_conv_dispatch,
    tap_phase_dispatch,
)


def spliced(mlir: str) -> str:
    """`mlir` with every kernel's calls spliced, or as it is where it calls none."""
    for kernel in KERNELS:
        if any(mark in mlir for mark in kernel.MARKS):
            mlir = kernel.splice(mlir)
    return mlir
