"""IREE compile targets: what `iree-compile` is told, which HAL driver runs the result, which rules go first.

    TARGETS["cuda"]   # IreeTarget(name="cuda", driver="cuda", flags=("--iree-cuda-target=sm_80", ...))

One backend per target is registered (`iree`, `iree-cuda`, `iree-rocm`,
`iree-vulkan`), each `IreeBackend(target=...)` with the same call
convention; the compile needs no device (CI compiles every target), running
needs one (`IreeDeviceError` says so when it is absent).
"""

from __future__ import annotations

import os
import platform

import attrs

from fx_rewrites.backends.iree import cpus

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
    - `isa`: llvm-cpu only, the vector ISA (`CPU_ISAS`) whose measured flags and performance rules it takes.
    - `dynamic_flags`: added to `perf_flags` for a module with a dynamic size (`IreeBackend.perf_flags_for`).
    """

    name: str
    driver: str
    flags: tuple[str, ...] = ()
    perf_flags: tuple[str, ...] = ()
    device: str = ""
    isa: str = ""
    dynamic_flags: tuple[str, ...] = ()


#: Measured on a 2-core AVX-512 host (benchmarks/runtime.py, docs/performance.md): data tiling packs matmul operands
#: into the tiles the microkernels want (ViT 2.7x, BERT and Llama 1.1-1.2x); channels-last convolutions run ResNet
#: 5x faster. Data tiling makes IREE's own attention lowering fail ("One or more operations with large vector
#: sizes"): llvm-cpu writes attention out (rules/performance.py), and a module the compiler rejects with these
#: flags is compiled again without them (`IreeBackend._compile_mlir`). Data tiling from GlobalOptimization, not
#: `--iree-opt-data-tiling`: that flag takes the DispatchCreation path, which computes a batched matmul wrong when
#: its left operand comes from a reduction over its rows (layer_norm(s) @ v on [2, 7, 7];
#: docs/iree-3.13-findings.md, section 10). Whole modules, iree-benchmark-module CPU time, this path / that one:
#: Whisper 1.03, BERT 1.04, ViT 0.99.
_DATA_TILING = "--iree-global-opt-data-tiling"
_CHANNELS_LAST = (
    "--iree-preprocessing-pass-pipeline=builtin.module(util.func(iree-preprocessing-convert-conv-to-channels-last))"
)
#: 2-D convolutions as im2col + matmul (iree-org/iree#22674), in GlobalOptimization: the matmul then takes data
#: tiling. ResNet-50, one thread, CPU time, interleaved, Intel Xeon (Sapphire Rapids): AVX2 (znver3) 5.2x -> 1.0x
#: eager, AVX-512 1.41x -> 1.08x (docs/performance.md, "Per ISA"). On both ISAs by the locked model runs (with the
#: mmt4d ukernel on AVX-512), without -> with it: ResNet-50 1.21 -> 0.89 (AVX-512), 6.06 -> 0.93 (AVX2), ResNeXt-50
#: 2.94 -> 1.21 and 2.11 -> 1.13, ConvNeXt-T level; MobileNetV2 5-9% slower with it (0.63-0.75 -> 0.69-0.80). On
#: AVX-512 it slows 3x3 and 7x7 convolutions alone and speeds the 1x1s over many channels (1024->256 on 14x14: 8.5x
#: -> 1.24x eager): a scope finer than the ISA (docs/performance.md, "im2col and the row partials per ISA, models").
#: So AVX-512 takes im2col per convolution shape in the graph instead (`pointwise_conv_as_matmul`,
#: `conv_as_im2col_matmul`: 1x1s and kxk over 256 channels or more; the rest IREE's direct convolution), AVX2 the flag
#: (docs/performance.md, "im2col per convolution shape")
_IM2COL = "--iree-global-opt-use-im2col-for-convs"
#: the data-tiled matmuls (`linalg.mmt4d`) through IREE's hand-written microkernel instead of its generated code.
#: AVX-512 only. One thread, CPU time, interleaved, Intel Xeon (Sapphire Rapids), unlocked probes at load 6-10, IREE
#: over eager without -> with it: runtime.py's resnet 1.96 -> 1.77, ViT 0.75 -> 0.70, BERT 0.68 -> 0.61, Llama
#: 0.60 -> 0.55, GPT-2 0.46 -> 0.44, Whisper encoder 0.90 -> 0.83, MobileNetV2 0.55 -> 0.52, ResNet-50 1.17 -> 1.17;
#: under the lock, a 1x1 convolution 2.43 -> 1.98, the linear 1.64 -> 1.40. On AVX2 (znver3) the models are level
#: within 2% (resnet 1.39 -> 1.42, ViT 0.76 -> 0.75) and ResNet-50 read slower: not taken there. A locked run on
#: AVX-512 (load 5-8): text models 7-19% faster, MobileNetV2 6%, ResNet-50 level, ViT and resnet +3-6% (level over
#: the two runs)
#: (docs/performance.md, "Forms and flags per ISA"). On AVX2 a float32 `mmt4d` compiles to the same instructions with
#: or without it (the 8x8x1 tile, its bitcode inlined; real Zen 3, docs/iree-3.13-findings.md "The float32 matmul on a
#: real AVX2 CPU"): nothing to gain there
_MMT4D_UKERNEL = "--iree-llvmcpu-enable-ukernels=mmt4d"
#: vector loops over a dynamic size peeled (a remainder loop) instead of masked. AVX2 only, and only for modules with a
#: dynamic size: IREE 3.13's default masks every vector of such a loop, which AVX2 does with `vmaskmovps` loads and
#: stores, slow on Zen 3 (AVX-512 has mask registers). Real Zen 3, one thread: exp(s - m) over [8, 272, D] 35.3 ->
#: 14.2 ms (D static: 15.5), the small MoE model's prefill attention alone 303 -> 248 ms, Qwen3-30B-A3B's 646 -> 504
#: (docs/iree-3.13-findings.md, "Vector loops over a dynamic size on AVX2"; docs/performance.md, "MoE prefill: where
#: it goes against eager"): whole prefill 1.16x -> 1.08x eager (small), 1.15x -> 1.07x (30B layer). Modules with no
#: dynamic size anywhere compile as before (not re-measured: no flag is added to them)
_PEEL = "--iree-llvmcpu-vector-pproc-strategy=peel"


@attrs.frozen
class CpuIsa:
    """A vector ISA the llvm-cpu target is tuned for: its flags chosen by measurement (docs/performance.md).

    - `name`: "avx512" or "avx2" (an `IreeTarget.isa`, a benchmark's `--isa`).
    - `features`: the /proc/cpuinfo flags a CPU needs to run code for it.
    - `target_cpu`: the `--iree-llvmcpu-target-cpu` for it on a host of another ISA (AVX2 measured on an
      AVX-512 host: znver3, AMD Zen 3, what IREE's `host` resolves to there); on a host of this ISA, `host`.
    - `perf_flags`: its `IreeTarget.perf_flags`.
    - `perf_rules`: the names of the performance rules (`rules/performance.py`) on for it, in phase order.
    - `target_features`: `--iree-llvmcpu-target-cpu-features` with `target_cpu` ("" for none).
    - `first_rules`: the names of first-phase rules on for it (`rules.FIRST_BY_ISA`: they must see the graph before
      the ISA-neutral rules of that phase rewrite it).
    - `dynamic_flags`: its `IreeTarget.dynamic_flags`.
    """

    name: str
    features: tuple[str, ...]
    target_cpu: str
    perf_flags: tuple[str, ...]
    perf_rules: tuple[str, ...]
    target_features: str = ""
    first_rules: tuple[str, ...] = ()
    dynamic_flags: tuple[str, ...] = ()


#: the llvm-cpu performance rules, in phase order (`rules/performance.py`; benchmarks/runtime.py measures each)
#: `index_by_arange_as_view` (rules/arange_index.py): transformers' padding mask over a static cache, 463-465 ms
#: gathered -> 6.2-6.7 ms on real Zen 3 (AVX2), locked (benchmarks/causal_mask.py); on AVX-512 unmeasured: the form it
#: writes is a view of the gathered tensor with no gather left, nothing added to run
_TRANSFORMER_RULES = (
    "index_by_arange_as_view",
    "attention_one_query_as_grouped_sums",
    "attention_by_head_groups",
    "attention_by_key_blocks",
    "attention_as_matmul_softmax",
    "softmax_matmul_normalized_after",
    "softmax_as_exp_times_reciprocal",
)
#: `attention_padded_to_tiles` (rules/attention_tiles.py, for AVX2's 8x8 tiles) is in performance.ALL but on for no
#: ISA: its locked model runs read 1-2% (ViT, the Whisper encoder) at load 11, and the Whisper encoder 1.17x slower
#: with it on a quiet host (load 1.5) (docs/performance.md)
#: `max_pool_without_unread_indices` (rules/pool_indices.py): the torch.compile route's max pooling as export gives it
#: (docs/performance.md, "A second host, both ISAs; the torch.compile route's convolutions as the export route's")
_CONV_RULES = (
    "patch_conv_as_matmul",
    "conv1d_as_matmul",
    "max_pool_without_unread_indices",
    "strided_pointwise_conv_as_slice",
    "conv3d_as_conv2d_over_frames",
    "grouped_conv_as_convs",
    "depthwise_conv_as_dispatch",
    "grouped_conv_as_dispatch",
    "depthwise_conv_as_taps",
    "depthwise_conv_as_row_partials",
)
#: AVX-512: convolutions as im2col + matmul per shape (rules/im2col.py) instead of IREE's global flag
_AVX512_CONV_RULES = (
    *_CONV_RULES,
    "conv_as_tap_dispatch_avx512",
    "pointwise_conv_as_dispatch_avx512",
    "batch_norm_into_pointwise_conv",
    "relu_into_pointwise_conv",
    "pointwise_conv_as_matmul",
    "conv_as_im2col_matmul",
)
# `pointwise_conv_as_dispatch_avx512` with the batch norm folded into it and the ReLU in its store
# (rules/pointwise_conv_dispatch.py), locked on Emerald Rapids, the route / eager without -> with: ResNet-50 1.12 ->
# 1.02 (quiet) and 1.08 -> 0.99 (load 4), MobileNetV2 0.43 -> 0.40, ResNeXt-50 1.12 -> 1.05, EfficientNet-B0 0.81 ->
# 0.75, MobileNetV3-L 0.56 -> 0.48 (load 4) (docs/performance.md, "A 1x1 convolution dispatch of our own").
# `conv_as_tap_dispatch[_avx512]` (rules/tap_conv_dispatch.py): 3x3s and 7x7 stems through the same kernel as
# taps, the batch norm and ReLU folded in as above; with it AVX2 takes the 1x1 dispatch and the folds too. The route
# / eager without -> with, locked: ResNet-50 AVX-512 1.02 -> 0.88, AVX2 1.09 -> 0.95 (docs/performance.md, "A kxk
# convolution dispatch of our own", with the other models)
#: AVX2: IREE's global im2col flag, and before it the 1x1s as a matmul over the channels in place (rules/im2col.py).
#: Real Zen 3, locked, route with -> without `pointwise_conv_as_matmul`: MobileNetV2 0.86x (0.81x, 0.83x in earlier
#: runs), EfficientNet-B0 0.94x, MobileNetV3-L 0.70x, ResNet-50 0.95x, runtime.py's resnet 0.98x
#: (docs/performance.md, "Attention padded to AVX2's tiles" and the section after it)
#: `conv_as_tap_matmuls` (rules/conv_taps.py): 3x3s at stride 1 as nine tap products summed instead of IREE's im2col
#: (15% of ResNet-50's module), for a weight the program holds. Real Zen 3, locked, the route with / without it:
#: ResNet-50's export route 0.97, 0.90, 0.90, 0.82 (0.94x eager against 1.04x; 1.10 once at load 12.7), runtime.py's
#: resnet 0.98, conv_classes.py's 3x3 64->64 0.80; torch.compile with the weights as inputs 1.03, 1.14, 0.90 (not taken
#: there: the rule declines a weight passed in) (docs/performance.md, "3x3 convolutions as tap products")
_AVX2_CONV_RULES = (
    *_CONV_RULES,
    "conv_as_tap_dispatch",
    "pointwise_conv_as_dispatch",
    "batch_norm_into_pointwise_conv",
    "relu_into_pointwise_conv",
    "pointwise_conv_as_matmul",
    "conv_as_tap_matmuls",
)
# `mlp_rows_padded_to_tiles` (rules/mlp_tiles.py, AVX2's 8-row tiles): ViT, the one runtime.py model it touches, 0.88x
# of the route with it on real Zen 3, locked and unlocked (docs/performance.md, "Where ViT and the Whisper encoder lose
# on AVX2"); not measured on AVX-512 (16-row tiles there)
# `depthwise_conv_as_row_partials` (5x5 and 7x7 depthwise at stride 1) on both ISAs by the locked model runs, with ->
# without it: ConvNeXt-T 1.33 -> 1.50 (AVX-512), 1.35 -> 1.37 and 1.29 -> 1.34 (AVX2), EfficientNet-B0 0.83 -> 1.03 and
# 0.79 -> 0.93, MobileNetV3-L 0.89 -> 1.00 and 0.80 -> 0.94 (docs/performance.md, "im2col and the row partials")
# `depthwise_conv_as_dispatch` (rules/grouped_conv_dispatch.py; depthwise convolutions at stride 1 and 2 through
# the hand-written dispatch, grouped_conv_dispatch.py) on both ISAs, before the taps and the row partials (which keep
# what it declines: dilation, widths under 8): the route with / without it, locked on Emerald Rapids, AVX-512 and AVX2:
# MobileNetV2 0.49 / 0.81 and 0.52 / 0.73 x eager, ConvNeXt-T 1.17 / 1.62 and 1.06 / 1.34, EfficientNet-B0 0.83 /
# 1.18 and 0.84 / 1.15, MobileNetV3-L 0.64 / 0.80 and 0.75 / 0.99 (docs/performance.md, "A depthwise convolution
# dispatch of our own"); `grouped_conv_as_dispatch` (the same kernel over a group's 2-32 input channels, kxk) on both,
# before `grouped_conv_as_convs`: ResNeXt-50 0.98 / 1.03 and 0.95 / 1.11, conv_classes.py's g8 and g32 rows 1.05 /
# 0.77 and 0.86 / 0.28 x eager (1.15-2.44 without it)
# `int4_decode_as_dispatch_for_iree` (rules/int4_decode.py): torchao's int4 g32 linears of a decode step through the
# hand-written int4 dispatch (int4_dispatch.py), 1.8-2.4x the byte form on real Zen 3 (docs/iree-3.13-findings.md
# section 49). AVX2 only: its kernel is written for 8-lane ymm vectors (a tile of 4 x 8 channels, 4 accumulators and
# 4 totals in 8 of the 16 ymm registers); AVX-512's 16 lanes would want another tile and masks, not written, and
# AVX-512 cannot be timed on the host it was measured on (no avx512 units), so AVX-512 keeps the byte form
# `a8int4_decode_as_dispatch_for_iree` (rules/a8int4_decode.py): torchao's int8-activation x int4 g32 linears of a
# decode step through the integer a8 int4 dispatch (a8int4_dispatch.py: `vpmaddubsw`, an AVX2 instruction; AVX-512
# would want its own tile and VNNI, not written), 2.2x the float int4 dispatch on 2816 x 1024 and 1.28x on 32000 x
# 1024 on real Zen 3 (benchmarks/a8int4_dispatch.py, docs/iree-3.13-findings.md section 53)
# `grouped_mm_packed_*_for_iree` (rules/moe_packed.py): MoE experts' weights laid out once as IREE's 16x16x1 tile
# reads them, the prefill's mmt4d and the decode's per-row products both reading it; the decode at Qwen3-30B-A3B's
# layer had run its one-row experts in 16-row tiles (findings 66, 67; docs/performance.md "MoE on AVX-512");
# `grouped_mm_packed_as_dispatch_for_iree` first: the prefill's experts as one hand-written dispatch over all experts
# reading that layout, 0.85-0.88x the prefill at the 30B layer, 0.80x small, peaks 0.95x / 0.90x eager (findings 70;
# docs/performance.md "MoE prefill's experts as one dispatch over all experts");
# `linear_over_rows_as_grouped_dispatch_avx512` (rules/f32_matmul.py, the same kernel for a linear over a Dim of rows)
# is off: 0.83-0.95x the prefill where measured, but the prefill then reads a packed copy of each projection the
# decode does not (the archive +76.5 MB at the 30B layer)
_AVX512_FIRST_RULES = (
    "grouped_mm_packed_as_dispatch_for_iree",
    "grouped_mm_packed_per_expert_for_iree",
    "grouped_mm_packed_per_row_for_iree",
)
# `grouped_mm_packed_as_dispatch_for_iree_avx2`: the same dispatch with AVX2's block (6x16 in 12 ymm, a strip of 16
# as two ymm of 8), the prefill's and the decode step's experts alike (one packed copy of the experts); this host
# emulating AVX2, each route in its own process, locked: the small model's prefill 0.90x eager (main's route
# 1.07-1.21x), decode 2.1-2.3x eager's tokens/s, peak 0.93x; the 30B layer's prefill 1.00x eager quiet, 1.12x loaded
# (main's 1.21-1.25x), decode 1.06-1.31x, peak 0.96x; the per-row form over the packed tensor decoded at 0.86-1.00x
# eager's: not taken on AVX2 (docs/performance.md, "MoE experts as one dispatch on AVX2")
_AVX2_FIRST_RULES = (
    "a8int4_decode_as_dispatch_for_iree",
    "int4_decode_as_dispatch_for_iree",
    "grouped_mm_packed_as_dispatch_for_iree_avx2",
)
# `linear_as_f32_dispatch` (rules/f32_matmul.py): float32 linears of a static row count through the hand-written 6x16
# matmul dispatch (f32_dispatch.py), 0.57-0.69 of IREE's 8x8x1 product alone on real Zen 3; the route without / with it,
# locked: ViT 1.41, BERT 1.32, Llama 1.25, the Whisper encoder 1.32, conv_classes.py's linear 1.25 (docs/performance.md
# "A float32 matmul kernel of our own on AVX2"). AVX2's block (6x16 in ymm) on AVX2 only
# `linear_as_f32_dispatch_avx512`: the same through AVX-512's 12x32 block in zmm, 0.60-0.67 of IREE's data-tiled mmt4d
# ukernel product alone on an Intel Xeon (AVX-512, Emerald Rapids class); the route with / without it, locked: ViT 0.79,
# BERT 0.76, Llama 0.85, the Whisper encoder 0.89, ConvNeXt-T 0.95, conv_classes.py's linear 0.84 (docs/performance.md
# "The float32 kernel on AVX-512, and the bias in its store"; findings 64). AVX2's, re-timed with the bias in the
# kernel's store (this host emulating AVX2): ViT 0.88, BERT 0.80, Llama 0.82, Whisper 0.88, ConvNeXt-T 0.92. Both
# take conv1d_as_matmul's and patch_conv_as_matmul's linears too (a weight seen through permutes and reshapes): with /
# without, locked, ViT 0.971 / 0.946 and the Whisper encoder 0.923 / 0.947 (AVX2 / AVX-512; docs/performance.md,
# "The flash dispatch on AVX2, and encoders' attention through it")
# `addmm_as_f32_dispatch[_avx512]`: transformers' Conv1D (GPT-2's addmm with W [K, N] held) through the same kernels:
# runtime.py's GPT-2 without / with, locked, 1.31 / 1.35 (AVX2 / AVX-512; the route 0.73x / 0.71x eager, was 0.94x /
# 1.05x; docs/performance.md "GPT-2's linears through the float32 dispatch")
# `attention_as_flash_dispatch_avx512` (rules/flash_attention.py): a masked attention over a Dim of query rows
# (compile_lm's prefill) through the hand-written flash dispatch (flash_attention_dispatch.py) with AVX-512's block (6
# rows x 64 keys in zmm), before the other attention rules (docs/performance.md, "MoE prefill's attention as a dispatch
# of our own"); `attention_as_flash_dispatch`: the same with AVX2's block (6 rows x 16 keys in 12 ymm, four passes a
# 64-key block): the small MoE model's prefill attention alone 0.40x of the key blocks' time (1.17x torch's is_causal
# flash), locked, this host emulating AVX2
# `unmasked_attention_as_flash_dispatch[_avx512]`: an attention without a mask over static rows (ViT, the Whisper
# encoder) through the same dispatch, no mask read: alone 0.57-0.81x of the written-out form's time; runtime.py's
# route without / with it, locked: ViT 1.05 / 1.05, the Whisper encoder 1.05 / 1.09 (AVX2 / AVX-512); the MoE small
# prefill (AVX2) 0.80x of the key blocks' (docs/performance.md, "The flash dispatch on AVX2, and encoders' attention")
_AVX512_ATTENTION = ("attention_as_flash_dispatch_avx512", "unmasked_attention_as_flash_dispatch_avx512")
_AVX2_ATTENTION = ("attention_as_flash_dispatch", "unmasked_attention_as_flash_dispatch")
CPU_ISAS: dict[str, CpuIsa] = {
    "avx512": CpuIsa(
        "avx512",
        ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
        "x86-64-v4",
        (_DATA_TILING, _CHANNELS_LAST, _MMT4D_UKERNEL),
        (
            *_AVX512_ATTENTION,
            *_TRANSFORMER_RULES,
            *_AVX512_CONV_RULES,
            "linear_as_f32_dispatch_avx512",
            "addmm_as_f32_dispatch_avx512",
        ),
        first_rules=_AVX512_FIRST_RULES,
    ),
    # znver3 without SSE4a: AMD's own extension, which Intel CPUs lack; LLVM emits its `insertq` for znver3 (a
    # Llama decoder's module died of SIGILL on an Intel Xeon before this)
    "avx2": CpuIsa(
        "avx2",
        ("avx2", "fma"),
        "znver3",
        (_DATA_TILING, _IM2COL, _CHANNELS_LAST),
        (
            *_AVX2_ATTENTION,
            *_TRANSFORMER_RULES,
            "mlp_rows_padded_to_tiles",
            *_AVX2_CONV_RULES,
            "linear_as_f32_dispatch",
            "addmm_as_f32_dispatch",
        ),
        target_features="-sse4a",
        first_rules=_AVX2_FIRST_RULES,
        dynamic_flags=(_PEEL,),
    ),
}


def cpu_flags() -> frozenset[str]:
    """This host's CPU feature flags (/proc/cpuinfo `flags`, or `Features` on ARM; `cpus.host`, the one reader);
    empty where unreadable."""
    return cpus.host().features


def host_isa() -> str:
    """The widest of `CPU_ISAS` this host runs ("avx512", "avx2"), or "" (not x86-64, or older than AVX2)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ""
    flags = cpu_flags()
    return next((isa.name for isa in CPU_ISAS.values() if flags.issuperset(isa.features)), "")


def llvm_cpu(isa: str = "host") -> IreeTarget:
    """The llvm-cpu target for vector ISA `isa` ("avx512", "avx2", or "host": this host's): code for this CPU
    (`--iree-llvmcpu-target-cpu=host`) where the host has that ISA, else for `CpuIsa.target_cpu`; that ISA's
    measured flags. A host of neither ISA gets `host` code and no performance flags."""
    if isa != "host" and isa not in CPU_ISAS:
        raise ValueError(f"isa={isa!r}: expected 'host' or one of {sorted(CPU_ISAS)}")
    resolved = host_isa() if isa == "host" else isa
    cpu = "host" if resolved == host_isa() else CPU_ISAS[resolved].target_cpu
    cpu_flags = [f"--iree-llvmcpu-target-cpu={cpu}"]
    if cpu != "host" and CPU_ISAS[resolved].target_features:
        cpu_flags.append(f"--iree-llvmcpu-target-cpu-features={CPU_ISAS[resolved].target_features}")
    return IreeTarget(
        name="llvm-cpu",
        driver="local-task",
        flags=(*cpu_flags, _KEEP_F64),
        perf_flags=CPU_ISAS[resolved].perf_flags if resolved else (),
        device="this host's CPU" if cpu == "host" else f"a {resolved.upper()} CPU ({cpu})",
        isa=resolved,
        dynamic_flags=CPU_ISAS[resolved].dynamic_flags if resolved else (),
    )


#: environment variable: the vector ISA (`CPU_ISAS`) the default llvm-cpu target (backend `iree`) builds for, read
#: once at import; unset, this host's. `avx2` on an AVX-512 host runs the tests with the code and flags an AVX2 CI
#: machine gets (znver3 without SSE4a).
ISA_ENV = "FX_REWRITES_IREE_ISA"


def _isa_from_environment() -> str:
    isa = os.environ.get(ISA_ENV, "").strip() or "host"
    if isa != "host" and isa not in CPU_ISAS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected 'host' or one of {sorted(CPU_ISAS)} (or leave it unset)")
    return isa


TARGETS: dict[str, IreeTarget] = {
    "llvm-cpu": llvm_cpu(_isa_from_environment()),
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
