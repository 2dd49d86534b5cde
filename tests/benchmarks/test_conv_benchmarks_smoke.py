"""benchmarks/conv_classes.py runs one op and its table names the rule that fired; benchmarks/scale_cnn.py's
table renders a row. No timings are asserted (the machine is shared); ResNet-50 itself is not compiled here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fx_rewrites.backends.iree import targets

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def modules():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import conv_classes
        import scale_cnn

        yield conv_classes, scale_cnn
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_conv_classes_one_op(modules, capfd):
    conv_classes, _ = modules
    assert conv_classes.main(["--cases", "g8", "--rounds", "2", "--no-inductor", "--shuffle"]) == 0
    out = capfd.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| grouped"))
    assert "grouped_conv_as_dispatch" in row and "not close" not in out, out


def test_scale_cnn_table(modules):
    _, scale_cnn = modules
    ms = {"median": 10.0, "min": 9.0, "max": 11.0}
    row = {
        "parameters": 23.5e6,
        "steps_s": {"export": 1.0},
        "peak_gb": 0.7,
        "rounds": 3,
        "ms": {"eager": ms, "Inductor": ms, "export route": {"median": 5.0, "min": 4.0, "max": 6.0}},
        "max_abs_diff": {"eager": 0.0, "Inductor": 1e-4, "export route": 2e-4},
        "float32_error": {"eager": 1e-4, "Inductor": 1e-4, "export route": 2e-4},
        "output_scale": 255.0,
    }
    text = scale_cnn.cnn_table(row, "a CPU")
    assert "| export route | 5.0 | 4.0-6.0 | 0.50 | 0.50 | 2.0e-04 | 2.0e-04 |" in text, text


@pytest.mark.skipif(
    targets.host_isa() != "avx512",
    reason="AVX2 is emulated on an AVX-512 host only (elsewhere --isa avx2 is this CPU)",
)
def test_avx2_is_measured_in_a_child_held_to_avx2():
    """`--isa avx2` on an AVX-512 host: a child whose torch runs AVX2 kernels (checked in it by cpu_isa.header)
    and IREE code for znver3; the table names the CPU and the ISA measured."""
    script = BENCHMARKS / "conv_classes.py"
    args = ["--isa", "avx2", "--cases", "linear", "--rounds", "1", "--no-inductor"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert "CPU: " in out and "avx512f" in out, out  # the CPU and its vector extensions
    assert "ISA measured: AVX2" in out and "target-cpu=znver3" in out and "torch AVX2 kernels" in out, out
    assert "| linear 1024->1024, 128 rows |" in out and "not close" not in out, out


def test_also_without_drops_the_named_flags(modules):
    """`--also-without data-tiling`: the route without the ISA's flags containing it, the rest kept; a name that is
    none of its flags is an error that lists them."""
    import cpu_isa

    backend = cpu_isa.backend("avx2")
    routes = cpu_isa.without(backend, "data-tiling, channels-last")
    assert set(routes) == {"-data-tiling", "-channels-last"}
    assert routes["-data-tiling"].perf_flags == tuple(f for f in backend.perf_flags if "data-tiling" not in f)
    assert len(routes["-channels-last"].perf_flags) == len(backend.perf_flags) - 1
    assert routes["-data-tiling"].rules is backend.rules and routes["-data-tiling"].cache is not backend.cache
    assert cpu_isa.without(backend, "") == {}
    with pytest.raises(SystemExit, match="--also-without no-such-flag: no performance rule of the ISA has that name"):
        cpu_isa.without(backend, "no-such-flag")


def test_also_without_a_rule_drops_that_rule_only(modules):
    """`--also-without depthwise_conv_as_taps`: the route with the ISA's performance phase less that rule, the
    other phases and the flags kept."""
    import cpu_isa

    from fx_rewrites.backends.iree.rules import performance

    backend = cpu_isa.backend("avx512")
    perf = performance.for_target("llvm-cpu", "avx512")
    route = cpu_isa.without(backend, "depthwise_conv_as_taps")["-depthwise_conv_as_taps"]
    assert route.perf_flags == backend.perf_flags and route.cache is not backend.cache
    names = [rule.name for rule in route.rules]
    assert names == [rule.name for rule in backend.rules if rule.name != "depthwise_conv_as_taps"]
    assert "depthwise_conv_as_taps" in perf.names() and "depthwise_conv_as_taps" not in names
    assert route.rules.name == backend.rules.name and len(route.rules.sets) == len(backend.rules.sets)


def test_also_without_f32_x_pad_compiles_with_the_row_copy(modules):
    """`--also-without f32_x_pad=16`: the route, its rules and flags kept, compiling with the float32 kernel's x
    rows copied 16 floats apart (`f32_dispatch.X_PAD` set for that compile only)."""
    import cpu_isa

    from fx_rewrites.backends.iree import f32_dispatch

    backend = cpu_isa.backend("avx512")
    route = cpu_isa.without(backend, "f32_x_pad=16")["-f32_x_pad=16"]
    assert route.rules is backend.rules and route.perf_flags == backend.perf_flags and route.cache is not backend.cache

    class Seen:
        def compile(self, *args):
            return dict(f32_dispatch.X_PAD)

    route._backend = Seen()
    assert route.compile(None, ()) == {"avx2": 16, "avx512": 16}
    assert f32_dispatch.X_PAD == {"avx2": 0, "avx512": 16}


def test_also_without_a_rule_plus_a_flag(modules):
    """`--also-without pointwise_conv_as_matmul/conv_as_im2col_matmul+im2col`: AVX-512's route less those rules, plus
    the performance flag of any ISA's table containing `im2col` (AVX2's IREE im2col flag): the route the rules
    replaced, in the same rounds."""
    import cpu_isa

    backend = cpu_isa.backend("avx512")
    spec = "pointwise_conv_as_matmul/conv_as_im2col_matmul+im2col"
    route = cpu_isa.without(backend, spec)[f"-{spec}"]
    assert route.perf_flags == (*backend.perf_flags, "--iree-global-opt-use-im2col-for-convs")
    for name in ("pointwise_conv_as_matmul", "conv_as_im2col_matmul"):
        assert name not in [rule.name for rule in route.rules] and name in [rule.name for rule in backend.rules]
    with pytest.raises(SystemExit, match="0 performance flags contain 'no-such-flag'"):
        cpu_isa.without(backend, "conv_as_im2col_matmul+no-such-flag")
    with pytest.raises(SystemExit, match="follows a rule's name only"):
        cpu_isa.without(backend, "im2col+data-tiling")


def test_also_without_plus_a_rule_adds_it(modules):
    """`--also-without +conv_as_im2col_matmul` on AVX2: the route with that performance rule of `performance.ALL`
    added after the ISA's own (which lacks it), the flags kept; `RULE+RULE2`: one rule less, the other added."""
    import cpu_isa

    backend = cpu_isa.backend("avx2")
    names = [rule.name for rule in backend.rules]
    assert "conv_as_im2col_matmul" not in names
    route = cpu_isa.without(backend, "+conv_as_im2col_matmul")["-+conv_as_im2col_matmul"]
    assert route.perf_flags == backend.perf_flags and route.cache is not backend.cache
    assert [rule.name for rule in route.rules] == [*names, "conv_as_im2col_matmul"]
    spec = "depthwise_conv_as_taps+conv_as_im2col_matmul"
    swapped = [rule.name for rule in cpu_isa.without(backend, spec)[f"-{spec}"].rules]
    assert swapped == [*(n for n in names if n != "depthwise_conv_as_taps"), "conv_as_im2col_matmul"]


def test_also_without_plus_a_whole_flag_adds_it(modules):
    """`--also-without +--iree-llvmcpu-matmul-tile-bytes=524288`: the route, its rules kept, plus that iree-compile
    flag as written (no ISA's table holds it); a flag not starting `--iree-` is still looked up in the tables."""
    import cpu_isa

    backend = cpu_isa.backend("avx2")
    spec = "+--iree-llvmcpu-matmul-tile-bytes=524288"
    route = cpu_isa.without(backend, spec)[f"-{spec}"]
    assert route.perf_flags == (*backend.perf_flags, "--iree-llvmcpu-matmul-tile-bytes=524288")
    assert [rule.name for rule in route.rules] == [rule.name for rule in backend.rules]
    with pytest.raises(SystemExit, match="0 performance flags contain 'llvmcpu-matmul-tile-bytes=524288'"):
        cpu_isa.without(backend, "+llvmcpu-matmul-tile-bytes=524288")


@pytest.mark.skipif(targets.host_isa() != "avx512", reason="the rule is AVX-512's (targets.CPU_ISAS)")
def test_conv_classes_shapes_names_the_rules_that_fired(modules, capfd):
    """`--shapes`: ResNet-50's convolutions one by one; a 3x3 over 512 channels on 7x7 takes the ISA's kxk dispatch
    (`conv_as_tap_dispatch_avx512` on AVX-512, `conv_as_tap_dispatch` on AVX2), named in the row's rules. The ISA is
    the one this process's torch runs: AVX-512 code cannot run on an AVX2 CPU, and a suite held to AVX2 (README)
    measures AVX2."""
    import torch

    conv_classes, _ = modules
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    argv = ["--shapes", "--cases", "3x3 512->512, 7x7", "--rounds", "1", "--no-inductor", "--no-before"]
    assert conv_classes.main([*argv, "--isa", "avx512" if avx512 else "avx2"]) == 0
    out = capfd.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 3x3 512->512, 7x7"))
    fired = row.rstrip(" |").rsplit("|", 1)[-1].strip().split(", ")
    assert ("conv_as_tap_dispatch_avx512" if avx512 else "conv_as_tap_dispatch") in fired, out
    assert "conv_as_im2col_matmul" not in fired and "not close" not in out, out
