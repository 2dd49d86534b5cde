"""Artifacts that travel (issue 32, item 4): a module is built for a CPU by name, records what it needs, and
`fx_rewrites.load` on a machine that lacks it raises `IreeCpuError` instead of dying of an illegal instruction.

The host's CPU is read through `cpus.host()`, which these tests replace to play another machine; the code that
runs here is built for a CPU this machine has. Four or five small IREE compiles.
"""

from __future__ import annotations

import json

import pytest
import torch

import fx_rewrites
from fx_rewrites.app.cli import main
from fx_rewrites.backends.iree import IreeBackend, cpus
from fx_rewrites.backends.iree.artifact import CALL_KEY
from fx_rewrites.backends.iree.runtime import function_reflections
from fx_rewrites.backends.iree.targets import llvm_cpu

AVX2_HOST = cpus.HostCpu("x86_64", "an AVX2 machine (Zen 3)", frozenset({*cpus.X86_64_V3, "sse", "sse2", "sse4a"}))
REAL = cpus.host()
RUNS_V3 = REAL.arch == "x86_64" and REAL.features.issuperset(cpus.X86_64_V3)

X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c lahf_lm abm sse4a bmi1 avx2 bmi2 hypervisor

processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU part\t: 0xd0c
"""


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 36, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _net() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    inputs = [torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    return Net().eval(), inputs


def _record(path) -> dict | None:
    return json.loads(function_reflections(path)["main"][CALL_KEY]).get("cpu")


def test_cpuinfo_is_read_for_x86_and_arm():
    x86 = cpus.parse_cpuinfo(X86_CPUINFO, "x86_64")
    assert x86.model == "AMD EPYC 7B13" and {"avx2", "sse4a", "hypervisor"} <= x86.features
    assert "avx512f" not in x86.features and cpus.level("x86_64", x86.features) == "x86-64-v3"
    arm = cpus.parse_cpuinfo(ARM_CPUINFO, "aarch64")
    assert arm.model == "0xd0c" and {"fp", "asimd", "asimddp", "atomics"} <= arm.features
    assert cpus.level("aarch64", arm.features) == "aarch64"
    # what a host build records: instruction-set flags only (not `hypervisor`, `cpuid`, `evtstrm`)
    assert "hypervisor" not in cpus.codegen_features("x86_64", x86.features)
    assert "sse4a" in cpus.codegen_features("x86_64", x86.features)
    assert cpus.codegen_features("aarch64", arm.features) == sorted(
        {"fp", "asimd", "atomics", "fphp", "asimdhp", "asimdrdm", "lrcpc", "asimddp", "crc32"}
    )


def test_the_requirement_follows_the_flags():
    flags = IreeBackend(target=llvm_cpu("host")).flags  # the host's, whatever FX_REWRITES_IREE_ISA says
    v3 = cpus.requirement(cpus.flags_for("x86-64-v3", flags), on=AVX2_HOST)
    assert v3 == {"target": "x86-64-v3", "arch": "x86_64", "features": sorted(cpus.X86_64_V3)}
    v4 = cpus.requirement(cpus.flags_for("x86-64-v4", flags), on=AVX2_HOST)
    assert set(v4["features"]) - set(v3["features"]) == {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    arm = cpus.requirement(cpus.flags_for("aarch64", flags), on=AVX2_HOST)
    assert arm == {"target": "aarch64", "arch": "aarch64", "features": ["asimd", "fp"]}
    host = cpus.requirement(cpus.flags_for("host", flags), on=AVX2_HOST)
    assert host["target"] == "host" and host["built_on"] == "an AVX2 machine (Zen 3)"
    assert host["features"] == cpus.codegen_features("x86_64", AVX2_HOST.features) and "avx2" in host["features"]
    # an LLVM CPU outside the table (the AVX2 stand-in of the benchmarks) or features added: not known, not checked
    znver3 = [*flags, "--iree-llvmcpu-target-cpu=znver3", "--iree-llvmcpu-target-cpu-features=-sse4a"]
    assert cpus.requirement(znver3, on=AVX2_HOST)["features"] is None
    plus = [*cpus.flags_for("x86-64-v3", flags), "--iree-llvmcpu-target-cpu-features=+avx512f"]
    assert cpus.requirement(plus, on=AVX2_HOST)["features"] is None
    # the flags keep everything but the CPU, its features and the triple
    assert [f for f in cpus.flags_for("aarch64", znver3) if "llvmcpu" in f] == [
        "--iree-llvmcpu-target-triple=aarch64-linux-gnu",
        "--iree-llvmcpu-target-cpu=generic",
    ]
    assert set(flags) - set(cpus.flags_for("aarch64", flags)) == {"--iree-llvmcpu-target-cpu=host"}
    with pytest.raises(ValueError, match=r"cpu='sse': expected one of host, x86-64-v3, x86-64-v4, aarch64"):
        cpus.flags_for("sse", flags)


def test_for_cpu_and_its_errors():
    backend = IreeBackend().for_cpu("host")  # the registered llvm-cpu target's CPU may be set otherwise
    assert backend.cpu == "host" and backend.for_cpu("aarch64").cpu == "aarch64"
    assert backend.for_cpu("aarch64").for_cpu("host").flags == backend.flags
    assert backend.for_cpu("x86-64-v3").perf_flags == backend.perf_flags
    from fx_rewrites.backends import get

    with pytest.raises(ValueError, match=r"builds cuda code; cpu='aarch64' applies to llvm-cpu"):
        get("iree-cuda").for_cpu("aarch64")
    with pytest.raises(ValueError, match=r"backend 'eager' builds code for no CPU by name. Fix: backend='iree'"):
        fx_rewrites.compile(Net(), (torch.randn(2, 3, 6, 6),), backend="eager", cpu="x86-64-v3")
    with pytest.raises(ValueError, match=r"cpu='arm': backend 'iree' builds for host, x86-64-v3, x86-64-v4, aarch64"):
        fx_rewrites.compile(Net(), (torch.randn(2, 3, 6, 6),), cpu="arm")


def test_saving_for_another_cpu_what_cannot_be_built_again_names_the_fix(tmp_path):
    """`Compiled.save(cpu=)` and `CompiledLM.save(cpu=)` share `backends.base.save_for_cpu`: a compiled model
    without a `retarget` (eager; an LM loaded from a file) raises with the fix; its own CPU saves as is."""
    from types import SimpleNamespace

    from fx_rewrites.backends.base import save_for_cpu

    eager = fx_rewrites.compile(Net(), (torch.randn(2, 3, 6, 6),), backend="eager")
    with pytest.raises(ValueError, match=r"cpu='x86-64-v3': this compiled model is built for no other CPU.*Fix"):
        eager.save(tmp_path / "net.vmfb", cpu="x86-64-v3")
    loaded_lm = SimpleNamespace(cpu="host", retarget=None)  # what load_lm gives: no model to compile again
    with pytest.raises(ValueError, match=r"loaded from a file\). Fix: compile with backend='iree'"):
        save_for_cpu(loaded_lm, tmp_path / "lm.vmfb", params=None, cpu="aarch64")
    assert save_for_cpu(loaded_lm, tmp_path / "lm.vmfb", params=None, cpu="host") is False
    assert save_for_cpu(loaded_lm, tmp_path / "lm.vmfb", params=None, cpu=None) is False
    assert not (tmp_path / "lm.vmfb").exists()


def test_a_module_for_avx512_refuses_to_load_where_avx512_is_missing(tmp_path, monkeypatch):
    model, inputs = _net()
    compiled = fx_rewrites.compile(model, (inputs[0],), cpu="x86-64-v4")
    assert compiled.cpu == "x86-64-v4"
    path = tmp_path / "avx512.vmfb"
    compiled.save(path)
    assert _record(path)["target"] == "x86-64-v4" and "avx512f" in _record(path)["features"]
    monkeypatch.setattr(cpus, "host", lambda: AVX2_HOST)
    with pytest.raises(cpus.IreeCpuError) as e:
        fx_rewrites.load(path)
    assert e.value.missing == ("avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl")
    message = str(e.value)
    for part in (
        f"{path} was compiled for x86-64-v4 (any x86-64 CPU with AVX-512",
        "uses CPU features this machine lacks: avx512bw, avx512cd, avx512dq, avx512f, avx512vl",
        "This machine (an AVX2 machine (Zen 3)) is x86-64-v3, with abm avx avx2",
        "SIGILL, illegal instruction",
        "Fix: compile it for a CPU this machine runs",
        "cpu='x86-64-v3' for a file any AVX2 machine runs",
    ):
        assert part in message, message
    # a BackendUnavailable: `check` and `compile` report it as "not run here"
    from fx_rewrites.backends import BackendUnavailable

    assert isinstance(e.value, BackendUnavailable)


@pytest.mark.skipif(not RUNS_V3, reason="x86-64-v3 code runs on an x86-64 machine with AVX2, FMA and BMI")
def test_a_module_for_avx2_loads_and_runs_on_an_avx2_machine(tmp_path, monkeypatch):
    model, inputs = _net()
    path = tmp_path / "avx2.vmfb"
    fx_rewrites.compile(model, (inputs[0],)).save(path, cpu="x86-64-v3")  # compiled again for the CPU asked
    assert _record(path) == {"target": "x86-64-v3", "arch": "x86_64", "features": sorted(cpus.X86_64_V3)}
    monkeypatch.setattr(cpus, "host", lambda: AVX2_HOST)
    loaded = fx_rewrites.load(path)
    for x in inputs:
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_host_build_records_this_machine_and_says_what_another_lacks(tmp_path, monkeypatch):
    model, inputs = _net()
    path = tmp_path / "host.vmfb"
    fx_rewrites.compile(model, (inputs[0],), cpu="host").save(path)
    record = _record(path)
    assert record["target"] == "host" and record["built_on"] == REAL.model
    assert record["features"] == cpus.codegen_features(REAL.arch, REAL.features)
    torch.testing.assert_close(fx_rewrites.load(path)(inputs[1]), model(inputs[1]), rtol=1e-5, atol=1e-5)
    if not record["features"]:
        pytest.skip("this machine's /proc/cpuinfo names no instruction-set feature")
    # the same file on a machine missing one of this one's features: the error names it
    lacking = cpus.HostCpu(REAL.arch, "another machine", REAL.features - {record["features"][-1]})
    monkeypatch.setattr(cpus, "host", lambda: lacking)
    with pytest.raises(cpus.IreeCpuError) as e:
        fx_rewrites.load(path)
    assert f"was compiled for the CPU it was compiled on ({REAL.model}) and uses CPU features this machine lacks: " in (
        str(e.value)
    )
    assert e.value.missing == (record["features"][-1],)


def test_code_for_another_architecture_compiles_saves_and_says_where_it_runs(tmp_path):
    model, inputs = _net()
    compiled = fx_rewrites.compile(model, (inputs[0],), cpu="aarch64")  # cross-compiled, not loaded
    path = tmp_path / "arm.vmfb"
    compiled.save(path)
    assert _record(path) == {"target": "aarch64", "arch": "aarch64", "features": ["asimd", "fp"]}
    if REAL.arch == "aarch64":
        torch.testing.assert_close(fx_rewrites.load(path)(inputs[0]), model(inputs[0]), rtol=1e-5, atol=1e-5)
        return
    expected = rf"compiled for aarch64 \(any 64-bit ARM CPU.*this machine is {REAL.arch}.*cannot run aarch64 code"
    with pytest.raises(cpus.IreeCpuError, match=expected):
        compiled(inputs[0])
    with pytest.raises(cpus.IreeCpuError, match=expected):
        fx_rewrites.load(path)


def test_a_file_without_a_cpu_record_loads_unchecked(tmp_path, monkeypatch):
    """Files saved before modules recorded their CPU (format version 1 without `cpu`) still load."""
    model, inputs = _net()
    monkeypatch.setattr(IreeBackend, "cpu_requirement", lambda self: None)
    path = tmp_path / "old.vmfb"
    fx_rewrites.compile(model, (inputs[0],)).save(path)
    document = json.loads(function_reflections(path)["main"][CALL_KEY])
    assert "cpu" not in document and document["version"] == 1
    monkeypatch.setattr(cpus, "host", lambda: cpus.HostCpu("x86_64", "a machine of no features", frozenset()))
    torch.testing.assert_close(fx_rewrites.load(path)(inputs[1]), model(inputs[1]), rtol=1e-5, atol=1e-5)


MODEL = """
import torch


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval(), (torch.randn(2, 16),)
"""


def test_cli_compile_target(tmp_path, capsys):
    (tmp_path / "model.py").write_text(MODEL)
    out = tmp_path / "arm.vmfb"
    code = main(["compile", f"{tmp_path / 'model.py'}:make", "-o", str(out), "--target", "aarch64"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert _record(out)["target"] == "aarch64"
    if REAL.arch != "aarch64":
        assert "not compared with eager: the module was compiled for aarch64 (any 64-bit ARM CPU" in printed
        assert "Run it (on a machine that runs aarch64 code):\n  iree-run-module" in printed
    code = main(["compile", f"{tmp_path / 'model.py'}:make", "-o", str(out), "--target", "armv7"])
    err = capsys.readouterr().err
    assert code == 2 and "--target armv7: backend 'iree' builds for host, x86-64-v3, x86-64-v4, aarch64" in err


@pytest.mark.slow  # two compile_lm (about 40 s on 2 quiet cores): the LM route's own CPU handling
def test_a_language_model_is_built_and_saved_for_another_cpu(tmp_path):
    """compile_lm(cpu=) and CompiledLM.save(cpu=): both functions record the CPU; an LM saved for x86-64-v3 from
    an aarch64 compile is compiled again for it, loads here and generates model.generate's tokens."""
    from tests import lm_models

    model, _ = lm_models.build("llama")
    lm = fx_rewrites.compile_lm(model, max_cache_len=16, cpu="aarch64")
    assert lm.cpu == "aarch64"
    lm.save(tmp_path / "arm.vmfb")
    for function in ("prefill", "decode"):
        record = json.loads(function_reflections(tmp_path / "arm.vmfb")[function][CALL_KEY])["cpu"]
        assert record == {"target": "aarch64", "arch": "aarch64", "features": ["asimd", "fp"]}
    ids = lm_models.prompt(5)
    if REAL.arch != "aarch64":
        with pytest.raises(cpus.IreeCpuError, match=r"cannot run aarch64 code"):
            lm.generate(ids, max_new_tokens=4)
    if not RUNS_V3:
        return
    lm.save(tmp_path / "avx2.vmfb", cpu="x86-64-v3")
    record = json.loads(function_reflections(tmp_path / "avx2.vmfb")["decode"][CALL_KEY])["cpu"]
    assert record["target"] == "x86-64-v3"
    loaded = fx_rewrites.load(tmp_path / "avx2.vmfb")
    assert torch.equal(loaded.generate(ids, max_new_tokens=4)[:, ids.shape[1] :], lm_models.reference(model, ids, 4))
