"""IREE compile targets: what `iree-compile` is told, which HAL driver runs the result, which rules go first.

    TARGETS["cuda"]   # IreeTarget(name="cuda", driver="cuda", flags=("--iree-cuda-target=sm_80", ...))

One backend per target is registered (`iree`, `iree-cuda`, `iree-rocm`,
`iree-vulkan`), each `IreeBackend(target=...)` with the same call
convention; the compile needs no device (CI compiles every target), running
needs one (`IreeDeviceError` says so when it is absent).
"""

from __future__ import annotations

import os

import attrs

#: environment variable: the CPU the llvm-cpu target builds for, read once at import: `CPU[,FEATURES]`
#: (`--iree-llvmcpu-target-cpu`, then LLVM features for `--iree-llvmcpu-target-cpu-features`); unset, `host`.
#: `znver3,-sse4a` runs the tests on an Intel AVX-512 host with the code an AVX2 AMD Zen 3 CI machine gets
#: (without AMD's SSE4a: its `insertq` is an illegal instruction on Intel).
TARGET_CPU_ENV = "FX_REWRITES_IREE_TARGET_CPU"


def _target_cpu_flags() -> tuple[str, ...]:
    cpu, _, features = os.environ.get(TARGET_CPU_ENV, "").strip().partition(",")
    flags = (f"--iree-llvmcpu-target-cpu={cpu.strip() or 'host'}",)
    return (*flags, f"--iree-llvmcpu-target-cpu-features={features.strip()}") if features.strip() else flags


#: llvm-cpu and CUDA/ROCm run f64 natively; IREE's default demotion to f32 breaks f64 inputs and outputs at
#: run time ("buffer view byte length 24 exceeds backing buffer byte length 12").
_KEEP_F64 = "--iree-input-demote-f64-to-f32=false"


@attrs.frozen
class IreeTarget:
    """One `iree-compile` target backend and the HAL driver that runs its code.

    - `name`: `--iree-hal-target-backends` (`llvm-cpu`, `cuda`, `rocm`, `vulkan-spirv`).
    - `driver`: the runtime's HAL driver (`local-task`, `cuda`, `hip`, `vulkan`).
    - `flags`: what code for this target needs (the architecture it is built for).
    - `perf_flags`: chosen by measurement (benchmarks/runtime.py); a module the compiler
      rejects with them is compiled again without them (`IreeBackend.compile`).
    - `device`: what the hardware is, for error messages.
    """

    name: str
    driver: str
    flags: tuple[str, ...] = ()
    perf_flags: tuple[str, ...] = ()
    device: str = ""


TARGETS: dict[str, IreeTarget] = {
    "llvm-cpu": IreeTarget(
        name="llvm-cpu",
        driver="local-task",
        flags=(*_target_cpu_flags(), _KEEP_F64),
        # Measured on this 2-core AVX-512 host (benchmarks/runtime.py, docs/performance.md): data tiling packs
        # matmul operands into the tiles the microkernels want (ViT 2.7x, BERT and Llama 1.1-1.2x); channels-last
        # convolutions run ResNet 5x faster. Data tiling makes IREE's own attention lowering fail ("One or more
        # operations with large vector sizes"): llvm-cpu writes attention out (rules/performance.py), and a module the
        # compiler rejects with these flags is compiled again without them (`IreeBackend._compile_mlir`).
        # Data tiling from GlobalOptimization, not `--iree-opt-data-tiling`: that flag takes the DispatchCreation
        # path, which computes a batched matmul wrong when its left operand comes from a reduction over its rows
        # (layer_norm(s) @ v on [2, 7, 7]; docs/iree-3.13-findings.md, section 10). Whole modules,
        # iree-benchmark-module CPU time, this path / that one: Whisper 1.03, BERT 1.04, ViT 0.99.
        perf_flags=(
            "--iree-global-opt-data-tiling",
            "--iree-preprocessing-pass-pipeline=builtin.module(util.func(iree-preprocessing-convert-conv-to-channels-last))",
        ),
        device="this host's CPU",
    ),
    "cuda": IreeTarget(
        name="cuda",
        driver="cuda",
        # IREE 3.13's CUDA target refuses sm_90 ("missing GPU target in #hal.executable.target"); PTX for
        # sm_80 is JIT-compiled by the driver and runs on Ampere, Ada and Hopper.
        flags=("--iree-cuda-target=sm_80", _KEEP_F64),
        device="an NVIDIA GPU (CUDA driver, libcuda.so)",
    ),
    "rocm": IreeTarget(
        name="rocm",
        driver="hip",
        flags=("--iree-rocm-target=gfx942", _KEEP_F64),  # MI300; pass flags=(...) for another chip
        device="an AMD GPU (HIP runtime, libamdhip64.so)",
    ),
    "vulkan-spirv": IreeTarget(
        name="vulkan-spirv",
        driver="vulkan",
        # IREE 3.13's default SPIR-V environment (a mobile baseline) has no Int64: BERT's mask fails ("failed to
        # legalize operation 'vector.insert_strided_slice'"). Desktop GPUs have it; the default is NVIDIA's
        # (pass flags=("--iree-vulkan-target=rdna3",) for AMD, see docs/performance.md). f64 is demoted.
        flags=("--iree-vulkan-target=ampere",),
        device="a Vulkan GPU (a Vulkan loader, libvulkan.so, and a driver)",
    ),
}

#: registered backend name -> target
BACKEND_TARGETS: dict[str, str] = {
    "iree": "llvm-cpu",
    "iree-cuda": "cuda",
    "iree-rocm": "rocm",
    "iree-vulkan": "vulkan-spirv",
}
