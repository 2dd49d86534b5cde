"""The llvm-cpu target per vector ISA (issue 32): `targets.llvm_cpu(isa)`, its flags and performance rules,
and that code for AVX2 is AVX2 code (no zmm register) on any x86 host, so an AVX-512 host measures AVX2."""

from __future__ import annotations

import platform
import re

import attrs
import pytest
import torch

import fx_rewrites
from fx_rewrites.backends.iree import TARGETS, CompileCache, IreeBackend
from fx_rewrites.backends.iree import targets as t
from fx_rewrites.backends.iree.rules import performance

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_every_isa_names_rules_that_exist_and_flags_iree_takes():
    for isa in t.CPU_ISAS.values():
        assert set(isa.perf_rules) <= set(performance.ALL.names()), isa.name
        assert len(set(isa.perf_rules)) == len(isa.perf_rules), f"{isa.name}: a rule named twice"
        rules = performance.for_target("llvm-cpu", isa.name)
        assert rules.names() == list(isa.perf_rules)
        assert performance.for_target("llvm-cpu", isa.name) is rules  # a backend's phase is found by identity
    assert not len(performance.for_target("llvm-cpu", ""))  # a CPU of no listed ISA: no measured rules
    assert performance.for_target("vulkan-spirv").names() == ["attention_as_matmul_softmax"]


#: what the model runs chose per ISA (docs/performance.md, "im2col and the depthwise row partials per ISA, whole
#: models"): the flag or rule, and whether each ISA takes it
MEASURED_CHOICES = {
    # AVX2: ResNet-50 6.5x slower without; AVX-512: im2col per shape by the rule instead (docs/performance.md, "im2col
    # per convolution shape")
    "--iree-global-opt-use-im2col-for-convs": {"avx512": False, "avx2": True},
    "conv_as_im2col_matmul": {"avx512": True, "avx2": False},
    # AVX2 (real Zen 3, locked): MobileNetV2 0.86x, EfficientNet-B0 0.94x, MobileNetV3-L 0.70x, ResNet-50 0.95x with it
    "pointwise_conv_as_matmul": {"avx512": True, "avx2": True},
    "--iree-llvmcpu-enable-ukernels=mmt4d": {"avx512": True, "avx2": False},  # level or slower on AVX2
    "depthwise_conv_as_row_partials": {"avx512": True, "avx2": True},  # ConvNeXt-T faster with it on both
    # the hand-written depthwise dispatch, before the taps and the partials: MobileNetV2, ConvNeXt-T, EfficientNet-B0,
    # MobileNetV3-L 0.60-0.84x (AVX-512) and 0.71-0.79x (AVX2) of the route without it (Emerald Rapids, locked)
    "depthwise_conv_as_dispatch": {"avx512": True, "avx2": True},
    # grouped convolutions through the same kernel: conv_classes.py's g8 and g32 rows 1.05 / 0.77 (AVX-512) and 0.86 /
    # 0.28 (AVX2) x eager against 1.15-2.44 without it; ResNeXt-50 in docs/performance.md
    "grouped_conv_as_dispatch": {"avx512": True, "avx2": True},
    # AVX2's 8x8 tiles: attention over 197 / 500 tokens padded to them (real Zen 3, locked: ViT 1.01, Whisper encoder 1.02,
    # inside the noise; one head of 500: its dispatches 2.38 -> 1.83 ms): on for neither until a quiet run shows a gain
    "attention_padded_to_tiles": {"avx512": False, "avx2": False},
    # an MLP over rows off AVX2's 8-row tiles padded to them: ViT 0.88x of the route on real Zen 3 (locked)
    "mlp_rows_padded_to_tiles": {"avx512": False, "avx2": True},
    # 3x3s at stride 1 as nine tap products instead of IREE's im2col: real Zen 3, locked, ResNet-50 0.90-0.97x,
    # runtime.py's resnet 0.98x of the route without it; AVX-512 not measured (no AVX-512 units on that host)
    "conv_as_tap_matmuls": {"avx512": False, "avx2": True},
    # float32 linears through the hand-written kernel of each ISA's register block (6x16 ymm, 12x32 zmm): the
    # transformers 12-24% faster with it on each (docs/performance.md, "The float32 kernel on AVX-512")
    "linear_as_f32_dispatch": {"avx512": False, "avx2": True},
    "linear_as_f32_dispatch_avx512": {"avx512": True, "avx2": False},
    # GPT-2's Conv1D (addmm of a held [K, N] weight) through the same kernels: runtime.py's GPT-2 1.31 / 1.35x faster
    # with it (AVX2 / AVX-512; docs/performance.md, "GPT-2's linears through the float32 dispatch")
    "addmm_as_f32_dispatch": {"avx512": False, "avx2": True},
    "addmm_as_f32_dispatch_avx512": {"avx512": True, "avx2": False},
    # a masked attention over a Dim of rows (compile_lm's prefill) through the hand-written flash dispatch, each ISA's
    # register block: the MoE prefill's attention alone 0.43 / 0.36x (AVX-512) and 0.44x (AVX2) of the key blocks' time
    # (docs/performance.md, "MoE prefill's attention as a dispatch of our own" and "... on AVX2, and encoders")
    "attention_as_flash_dispatch_avx512": {"avx512": True, "avx2": False},
    "attention_as_flash_dispatch": {"avx512": False, "avx2": True},
    # an unmasked attention over static rows (ViT, the Whisper encoder) through the same dispatch: faster on both models
    # on both ISAs (the same section)
    "unmasked_attention_as_flash_dispatch_avx512": {"avx512": True, "avx2": False},
    "unmasked_attention_as_flash_dispatch": {"avx512": False, "avx2": True},
    # a linear over a Dim of rows through the grouped experts kernel: the prefill 0.83-0.95x, but a packed copy of each
    # projection beside the decode's weight (a 0.1B Llama's archive 1.03x -> 1.63x its weights): off until the decode
    # reads the same copy (docs/performance.md, "MoE prefill's experts as one dispatch over all experts")
    "linear_over_rows_as_grouped_dispatch_avx512": {"avx512": False, "avx2": False},
}


@pytest.mark.parametrize("choice", list(MEASURED_CHOICES))
def test_each_isa_takes_the_flags_and_rules_measured_for_it(choice):
    """The llvm-cpu target of each ISA, and a backend built on it, carry the flags and performance rules its own
    measurements chose: `llvm_cpu("avx2")` and `llvm_cpu("avx512")` differ where the measurements did."""
    for isa, taken in MEASURED_CHOICES[choice].items():
        backend = IreeBackend(target=t.llvm_cpu(isa))
        if choice.startswith("--"):
            assert (choice in t.llvm_cpu(isa).perf_flags) is taken, (isa, t.llvm_cpu(isa).perf_flags)
            assert (choice in backend.perf_flags) is taken, (isa, backend.perf_flags)
        else:
            assert (choice in performance.for_target("llvm-cpu", isa).names()) is taken, isa
            assert (choice in [rule.name for rule in backend.rules]) is taken, isa


def test_the_target_of_an_isa_compiles_for_this_cpu_where_it_has_the_isa():
    host = t.host_isa()
    for name, isa in t.CPU_ISAS.items():
        target = t.llvm_cpu(name)
        cpu = "host" if name == host else isa.target_cpu
        assert f"--iree-llvmcpu-target-cpu={cpu}" in target.flags
        features = [f for f in target.flags if f.startswith("--iree-llvmcpu-target-cpu-features=")]
        # a features flag only where the ISA names features (AVX2's -sse4a) and the code is for another CPU: on a real
        # AVX2 host the AVX-512 target (x86-64-v4) has none (this assertion failed there, expecting an empty flag)
        wanted = cpu != "host" and isa.target_features
        assert features == ([f"--iree-llvmcpu-target-cpu-features={isa.target_features}"] if wanted else [])
        assert (target.name, target.driver, target.isa, target.perf_flags) == (
            "llvm-cpu",
            "local-task",
            name,
            isa.perf_flags,
        )
    # the default target is the host's, or the ISA FX_REWRITES_IREE_ISA names (AVX2 tested on an AVX-512 host)
    chosen = t._isa_from_environment()
    assert t.llvm_cpu(chosen) == TARGETS["llvm-cpu"]
    assert TARGETS["llvm-cpu"].isa == (host if chosen == "host" else chosen)
    with pytest.raises(ValueError, match=r"isa='sse': expected 'host' or one of \['avx2', 'avx512'\]"):
        t.llvm_cpu("sse")


def test_host_isa_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(t.platform, "machine", lambda: "x86_64")
    for flags, expected in (
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx512"),
        ({"avx2", "fma", "avx512f"}, "avx2"),  # AVX-512 foundation alone (Knights Landing): not the tuned ISA
        ({"avx2", "fma"}, "avx2"),
        ({"avx", "sse4_2"}, ""),
    ):
        monkeypatch.setattr(t, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert t.host_isa() == expected, flags
    monkeypatch.setattr(t.platform, "machine", lambda: "aarch64")
    assert t.host_isa() == ""


def test_a_backend_takes_its_isa_rules():
    for name in t.CPU_ISAS:
        backend = IreeBackend(target=t.llvm_cpu(name))
        assert backend.rules.sets[-1] is performance.for_target("llvm-cpu", name)
        assert backend.perf_flags == t.CPU_ISAS[name].perf_flags


@pytest.mark.skipif(t.host_isa() == "", reason="AVX2 code runs on an x86-64 host with AVX2 and FMA only")
def test_avx2_code_runs_here_and_matches_eager():
    """The AVX2 target's code runs on any AVX2 host, Intel's too (znver3 without AMD's SSE4a)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 36, 5)
    )
    inputs = [torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    backend = IreeBackend(target=t.llvm_cpu("avx2"), driver="local-sync", cache=CompileCache())
    fn = backend.compile(
        fx_rewrites.apply(torch.export.export(module.eval(), (inputs[0],)), backend.rules).program, (inputs[0],)
    )
    for x in inputs:
        torch.testing.assert_close(fn(x), module(x), rtol=1e-5, atol=1e-5)


def _vector_registers(isa: str, tmp_path) -> dict[str, int]:
    """Compile a linear and a 3x3 convolution for `isa`'s target (no run: any x86 host) and count the vector
    registers its assembly names."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(8, 16, 3, padding=1)
            self.fc = torch.nn.Linear(16, 32)

        def forward(self, x):
            return self.fc(self.conv(x).mean((2, 3)))

    torch.manual_seed(0)
    x = torch.randn(2, 8, 12, 12)
    backend = IreeBackend(target=t.llvm_cpu(isa), cache=CompileCache())
    dump = tmp_path / isa
    backend = attrs.evolve(backend, flags=(*backend.flags, f"--iree-hal-dump-executable-intermediates-to={dump}"))
    backend.artifact(fx_rewrites.apply(torch.export.export(Net().eval(), (x,)), backend.rules).program)
    text = "\n".join(p.read_text() for p in dump.glob("*.s"))
    assert text, f"no assembly dumped in {dump}"
    found = {reg: len(re.findall(rf"%{reg}\d", text)) for reg in ("xmm", "ymm", "zmm")}
    # SSE4a (AMD's own; znver3 has it, Intel CPUs do not): an illegal instruction on an Intel host
    found["sse4a"] = len(re.findall(r"^\s+(insertq|extrq|movntss|movntsd)\b", text, re.MULTILINE))
    return found


@pytest.mark.skipif(not X86, reason="x86-64 code: the llvm-cpu target of another host is not x86")
def test_avx2_code_uses_no_avx512_registers(tmp_path):
    """What makes an AVX-512 host's AVX2 figures AVX2's: the code for `llvm_cpu("avx2")` (znver3 there) names
    ymm registers and no zmm; the AVX-512 target's names zmm."""
    avx2 = _vector_registers("avx2", tmp_path)
    assert avx2["zmm"] == 0 and avx2["ymm"] > 0 and avx2["sse4a"] == 0, avx2
    avx512 = _vector_registers("avx512", tmp_path)
    assert avx512["zmm"] > 0, avx512


@pytest.mark.skipif(not X86, reason="the vector ISAs listed are x86's")
def test_the_default_target_takes_the_isa_the_environment_names():
    import os
    import subprocess
    import sys

    show = "from fx_rewrites.backends.iree import TARGETS; t = TARGETS['llvm-cpu']; print(t.isa, *t.flags)"
    for isa in t.CPU_ISAS:
        env = {**os.environ, t.ISA_ENV: isa}
        out = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split()[0] == isa, out.stdout
        assert out.stdout.split()[1:] == list(t.llvm_cpu(isa).flags), out.stdout
    with pytest.raises(subprocess.CalledProcessError) as info:
        subprocess.run(
            [sys.executable, "-c", show],
            env={**os.environ, t.ISA_ENV: "sse2"},
            capture_output=True,
            text=True,
            check=True,
        )
    assert "FX_REWRITES_IREE_ISA='sse2'" in info.value.stderr
