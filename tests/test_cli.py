"""The `fx-rewrites` command line: check, explain (text and HTML page), rules.

Commands run in-process through `fx_rewrites.app.cli.main([...])` (one through the
installed entry point), on a model file written to a temporary directory.
"""

from __future__ import annotations

import argparse
import html.parser
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import attrs
import pytest
import torch

import fx_rewrites
from fx_rewrites import backends
from fx_rewrites import explain as rx
from fx_rewrites.app.cli import main
from tests.outside import require_program

MODEL = """
import torch
import torch.nn.functional as F


class Net(torch.nn.Module):
    # exports with max_pool2d's stride missing and a lifted torch.tensor constant (lift_fresh_copy + detach_)
    def forward(self, x):
        return F.max_pool2d(x, 2) + torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)


def make():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(2, 3, 8, 8),)


def boom():
    raise ValueError("weights file /nope/w.pt not found")


def not_a_tuple():
    return Net()


def bare_tensor():
    return Net(), torch.randn(2, 3, 8, 8)


class Branchy(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x + 1
        return x - 1


def branchy():
    return Branchy(), (torch.ones(2, 3),)


class Median(torch.nn.Module):
    def forward(self, x):
        return torch.median(x)


def median():  # aten.median: no IREE lowering, no torch decomposition and no rule for it (yet)
    return Median(), (torch.randn(2, 8),)


class Keyed(torch.nn.Module):
    # called as transformers models are: a tensor and a flag by keyword
    def forward(self, x, mask=None, use_cache=True):
        y = F.max_pool2d(x, 2) * mask
        return y + 1 if use_cache else y - 1


def keyed():
    torch.manual_seed(0)
    return Keyed(), (torch.randn(2, 3, 8, 8),), {"mask": torch.rand(1, 3, 1, 1), "use_cache": False}


def kwargs_not_a_dict():
    return Keyed(), (torch.randn(2, 3, 8, 8),), [False]


class Dropped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def left_in_train_mode():
    torch.manual_seed(0)
    return Dropped(), (torch.randn(4, 8),)


def in_eval_mode():
    torch.manual_seed(0)
    return Dropped().eval(), (torch.randn(4, 8),)


class RunningMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.lin(x) - self.mean


def running_mean():  # updates a buffer in forward
    torch.manual_seed(0)
    return RunningMean(), (torch.randn(3, 4),)
"""


#: lines of MODEL the messages must point at
BOOM_LINE = next(i for i, line in enumerate(MODEL.splitlines(), 1) if "raise ValueError" in line)
BRANCH_LINE = next(i for i, line in enumerate(MODEL.splitlines(), 1) if "if x.sum() > 0:" in line)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """model.py, a saved program with a dynamic batch (net.pt2), inputs for it, and broken archives."""
    d = tmp_path_factory.mktemp("cli")
    model = d / "model.py"
    model.write_text(MODEL)
    namespace: dict = {}
    exec(compile(MODEL, str(model), "exec"), namespace)
    module, args = namespace["make"]()
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(module, args, dynamic_shapes=({0: batch},))
    pt2 = d / "net.pt2"
    torch.export.save(ep, pt2)
    data = pt2.read_bytes()
    (d / "truncated.pt2").write_bytes(data[: len(data) // 2])
    (d / "corrupt.pt2").write_bytes(os.urandom(4096))
    _repack(pt2, d / "pickled.pt2")
    torch.save(module.state_dict() | {"w": torch.randn(2)}, d / "checkpoint.pt2")  # torch.save, named .pt2
    torch.save({"w": torch.randn(2)}, d / "legacy.pt2", _use_new_zipfile_serialization=False)
    torch.save((torch.randn(4, 3, 8, 8),), d / "inputs.pt")
    torch.save((torch.randn(4, 3, 8, 8), torch.randn(3)), d / "two_inputs.pt")
    torch.save(torch.randn(4, 3, 8, 8), d / "tensor.pt")
    torch.save((argparse.Namespace(),), d / "object.pt")
    return {"dir": d, "model": model, "pt2": pt2}


def _repack(src: Path, dst: Path) -> None:
    """A copy of a .pt2 whose constants say they are pickled (what torch.export.load would unpickle)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("_constants_config.json"):
                config = json.loads(data)
                for meta in config["config"].values():
                    meta["use_pickle"] = True
                data = json.dumps(config).encode()
            zout.writestr(info, data)


@pytest.fixture(autouse=True)
def _tables_at_the_width_of_a_pipe(monkeypatch):
    """The commands' tables go to capsys as to a pipe: 120 columns, whatever $COLUMNS the run inherited (a
    terminal's, or pytest-xdist's workers' 80, where a long tmp path wrapped 'pool_stride_defaults x1' in two)."""
    monkeypatch.delenv("COLUMNS", raising=False)


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ----------------------------------------------------------------------------- check


def test_check_factory_passes_on_iree(files, capsys):
    code, out, err = _run(capsys, "check", f"{files['model']}:make")
    assert code == 0, out + err
    for rule in ("pool_stride_defaults x1", "lift_fresh_copy_to_clone x1", "drop_detach_ x1"):
        assert rule in out
    # as is, IREE rejects the in-place detach_ (a numbered note gives the library's message); after the rules it runs
    assert "IreeCompileError [1]" in out and "[1] IreeCompileError: IREE could not compile `aten.detach_`" in out
    assert re.search(r"│ ok\s+│ 0\.00e\+00", out)
    assert "PASS: after the rules, iree matches eager" in out
    assert "inputs: f32[2, 3, 8, 8] (the factory)" in out


def test_a_factory_may_return_keyword_arguments(files, capsys, tmp_path):
    """make() may return (module, args, kwargs): check, explain and compile call the model with them."""
    spec = f"{files['model']}:keyed"
    code, out, err = _run(capsys, "check", spec, "--backend", "eager")
    assert code == 0 and "PASS" in out, out + err
    assert "inputs: f32[2, 3, 8, 8], f32[1, 3, 1, 1], False (the factory)" in out
    code, out, err = _run(capsys, "explain", spec)
    assert code == 0 and "pool_stride_defaults" in out, out + err
    code, out, err = _run(capsys, "compile", spec, "-o", tmp_path / "keyed.vmfb")
    assert code == 0 and "on the example inputs vs eager: ok" in out, out + err
    x, mask = torch.randn(2, 3, 8, 8), torch.rand(1, 3, 1, 1)
    expected = torch.nn.functional.max_pool2d(x, 2) * mask - 1
    torch.testing.assert_close(fx_rewrites.load(tmp_path / "keyed.vmfb")(x, mask=mask), expected)


def test_a_model_left_in_train_mode_is_told_to_call_eval(files, capsys, tmp_path):
    """Dropout in training mode draws new masks on each call: WrongResult, and the note names the cause."""
    code, out, err = _run(capsys, "check", f"{files['model']}:left_in_train_mode", "--backend", "eager")
    assert code == 1 and "WrongResult" in out, out + err
    assert "note: the model is in training mode (Dropout at 'drop'): dropout draws new random masks" in out
    assert "Fix: return module.eval() from the factory." in out
    code, out, err = _run(capsys, "check", f"{files['model']}:in_eval_mode", "--backend", "eager")
    assert code == 0 and "training mode" not in out, out + err
    namespace: dict = {}
    exec(MODEL, namespace)
    module, args = namespace["left_in_train_mode"]()
    torch.export.save(torch.export.export(module, args), tmp_path / "train.pt2")
    code, out, err = _run(capsys, "check", tmp_path / "train.pt2", "--backend", "eager")
    assert code == 1 and "note: the saved program was exported in training mode: its dropout (" in out, out + err


def test_check_table_fits_an_80_column_terminal(files, capsys, monkeypatch):
    """The table was forced to at least 120 columns, so in an 80-column terminal every row wrapped."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = _run(capsys, "check", f"{files['model']}:make", "--backend", "eager")
    assert code == 0, out + err
    table = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert len(table) >= 5 and max(len(line) for line in table) <= 80, "\n".join(table)


@pytest.mark.parametrize("backend", ["eager", "iree"])
def test_check_passes_a_model_that_updates_a_buffer(files, capsys, backend):
    """Issue 27: the rewritten program run by torch, then the compiled model, shared one running mean, so
    the second saw the first's update: a false FAIL (0.884 off), even on the eager backend."""
    code, out, err = _run(capsys, "check", f"{files['model']}:running_mean", "--backend", backend)
    assert code == 0, out + err
    assert "the rewritten program run by torch vs eager: ok" in out
    assert f"PASS: after the rules, {backend} matches eager" in out


def test_check_saved_program_gets_random_inputs_at_hint_sizes(files, capsys):
    code, out, err = _run(capsys, "check", files["pt2"])
    assert code == 0, out + err
    assert "pool_stride_defaults x1" in out and "PASS" in out
    assert "inputs: f32[2, 3, 8, 8] (random" in out  # the symbolic batch at its hint, 2


def test_check_inputs_file(files, capsys):
    code, out, err = _run(capsys, "check", files["pt2"], "--inputs", files["dir"] / "inputs.pt")
    assert code == 0, out + err
    assert f"inputs: f32[4, 3, 8, 8] ({files['dir'] / 'inputs.pt'})" in out and "PASS" in out


def test_check_fails_with_exit_1_when_the_backend_still_rejects_the_model(files, capsys):
    code, out, err = _run(capsys, "check", f"{files['model']}:median", "--verbose")
    assert code == 1, out + err
    assert "FAIL: after the rules, IreeCompileError" in out
    assert "[2] IreeCompileError: IREE could not compile `aten.median` (node 'median')" in out  # names op and node
    # --verbose: the traceback and iree-compile's own diagnostics
    assert "--- after rules: traceback" in out and "--- after rules: diagnostics" in out
    assert "failed to legalize operation 'torch.operator'" in out


def test_without_verbose_the_note_says_how_to_see_the_compiler_output(files, capsys):
    """A shell user cannot read an exception's `.diagnostics`: the note points at --verbose instead."""
    code, out, _ = _run(capsys, "check", f"{files['model']}:median")
    assert code == 1
    assert "(--verbose prints iree-compile's whole output)" in out
    assert ".diagnostics" not in out and "--- after rules: diagnostics" not in out


def test_describe_error_cuts_at_a_word():
    from fx_rewrites.app.cli.common import describe_error

    words = " ".join(f"word{i:03d}" for i in range(200))  # 1,599 characters
    note = describe_error(ValueError(words), 300)
    assert note.startswith("ValueError: word000 word001") and note.endswith(" … (--verbose shows all of it)")
    kept = note.removeprefix("ValueError: ").removesuffix(" … (--verbose shows all of it)")
    assert len(kept) <= 300 and kept.split()[-1] == f"word{len(kept.split()) - 1:03d}"  # a whole word last
    assert describe_error(ValueError(words), None) == f"ValueError: {words}"


def test_demo_notes_are_whole_sentences_and_verbose_adds_the_compiler_output(capsys):
    code, out, _ = _run(capsys, "demo", "--only", "tensor_literals")
    assert code == 0
    note = next(line for line in out.splitlines() if line.startswith("[1] IreeCompileError:"))
    # the hint after the error, cut at 300 characters mid-word before, is there whole, and the op's measured
    # record after it
    assert "into ops IREE knows. IREE " in note, note
    assert re.search(
        r"measured record for `aten\.detach_\.default` \(iree\.legality\): failed \d+x\. "
        r"\(--verbose prints iree-compile's whole output\)$",
        note,
    ), note
    code, out, _ = _run(capsys, "demo", "--only", "tensor_literals", "--verbose")
    assert code == 0 and "--- tensor_literals, as is: iree-compile's output" in out
    assert "failed to legalize operation 'torch.operator'" in out


def test_check_through_the_installed_entry_point(files):
    exe = shutil.which("fx-rewrites")
    assert exe, "the fx-rewrites entry point is not installed: pip install -e '.[test,iree]'"
    proc = subprocess.run(
        [exe, "check", f"{files['model']}:make", "--backend", "eager"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: after the rules, eager matches eager" in proc.stdout


# ----------------------------------------------------------------------------- errors: exit 2, a message naming the fix

ERRORS = {
    # id: (argv after "check" with {d}: the files directory, text the message must contain)
    "missing .py": (["{d}/nope.py:make"], ["no such file: {d}/nope.py", "Fix: check the path"]),
    "missing .pt2": (["{d}/nope.pt2"], ["no such file: {d}/nope.pt2", "Fix: check the path"]),
    "no factory given": (["{d}/model.py"], ["no factory", "Fix: add the function", "model.py:make_model"]),
    "missing factory name": (
        ["{d}/model.py:make_net"],
        ["has no 'make_net'", "its functions are make, boom,", "Fix: name the function", "model.py:make"],
    ),
    "factory raises": (
        ["{d}/model.py:boom"],
        [
            "the factory {d}/model.py:boom raised ValueError: weights file /nope/w.pt not found",
            "model.py:{boom}",
            "Fix:",
        ],
    ),
    "factory returns non-tuple": (
        ["{d}/model.py:not_a_tuple"],
        ["returned a Net", "Fix: not_a_tuple() must return (module, example_args)"],
    ),
    "factory returns kwargs not a dict": (
        ["{d}/model.py:kwargs_not_a_dict"],
        ["returned a list as example_kwargs", "the dict of forward()'s keyword arguments by name"],
    ),
    "factory returns a bare tensor": (
        ["{d}/model.py:bare_tensor"],
        ["returned a Tensor as example_args", "for one input write `(x,)`"],
    ),
    "corrupt .pt2": (
        ["{d}/corrupt.pt2"],
        ["is not a .pt2 archive", "Fix: save the program again with torch.export.save", "PytorchStreamReader failed"],
    ),
    "torch.save checkpoint named .pt2": (
        ["{d}/checkpoint.pt2"],
        [
            "checkpoint.pt2 is a torch.save checkpoint (its data.pkl holds a state dict or a pickled module), "
            "not an ExportedProgram",
            "Fix: export the model and save that, `torch.export.save(torch.export.export(model.eval()",
            "model.load_state_dict(torch.load(path))",
        ],
    ),
    "legacy torch.save named .pt2": (["{d}/legacy.pt2"], ["is a torch.save checkpoint in its legacy pickle format"]),
    "truncated .pt2": (
        ["{d}/truncated.pt2"],
        ["truncated or damaged", "Fix: save the program again", "PytorchStreamReader failed"],
    ),
    "pickled .pt2": (["{d}/pickled.pt2"], ["would unpickle: lifted_tensor_0", "does not load it", "Fix:"]),
    "torch cannot export": (
        ["{d}/model.py:branchy"],
        [
            "torch.export.export could not export the model",
            "model.py:{branch} (`if x.sum() > 0:`)",
            "Fix: Python control flow on a tensor's value",
            "torch.cond",
            "Could not guard on data-dependent expression",  # torch's own error, passed on
            "draft_export",
        ],
    ),
    "--inputs count": (
        ["{d}/net.pt2", "--inputs", "{d}/two_inputs.pt"],
        ["holds 2 inputs", "takes 1 (x f32[s", "Fix: save one value per input"],
    ),
    "--inputs not a tuple": (
        ["{d}/net.pt2", "--inputs", "{d}/tensor.pt"],
        ["holds a Tensor", "torch.save((x,), path)"],
    ),
    "--inputs pickled object": (
        ["{d}/net.pt2", "--inputs", "{d}/object.pt"],
        ["torch.load(weights_only=True)", "Fix: save a tuple of tensors", "Unsupported global"],
    ),
    "unknown backend": (["{d}/model.py:make", "--backend", "tvm"], ["no backend named 'tvm'", "Fix: pass one"]),
    "not a model": (["{d}/inputs.pt"], ["cannot tell what", "Fix: give PATH.py:FACTORY"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_check_errors_exit_2_with_the_fix(files, capsys, case):
    argv, expected = ERRORS[case]
    where = {"d": str(files["dir"]), "boom": BOOM_LINE, "branch": BRANCH_LINE}
    code, out, err = _run(capsys, "check", *(a.format(**where) for a in argv))
    assert code == 2, out + err
    assert out == ""
    assert err.startswith("fx-rewrites check: error: ")
    for text in expected:
        assert text.format(**where) in err, f"{text!r} not in:\n{err}"
    assert "Traceback" not in err  # that is --verbose's


def test_verbose_adds_the_traceback(files, capsys):
    code, _, err = _run(capsys, "check", f"{files['model']}:boom")
    assert code == 2 and "(--verbose adds the traceback)" in err
    code, _, err = _run(capsys, "check", f"{files['model']}:boom", "--verbose")
    assert code == 2
    assert "Traceback (most recent call last)" in err and 'raise ValueError("weights file' in err


def test_usage_errors_exit_2(capsys):
    assert main(["check"]) == 2
    assert "the following arguments are required: MODEL" in capsys.readouterr().err
    assert main(["check", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "read with torch.export.load only, after checking it holds no pickled objects" in help_text


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_load_neither_torch_nor_a_rule_pack(flag):
    """`fx-rewrites --version` took 3-5 s importing torch and every rule pack; each command imports its own."""
    code = (
        "import sys; from fx_rewrites.app.cli import main; "
        f"status = main([{flag!r}]); "
        "print('loaded:', sorted(m for m in ('torch', 'fx_rewrites.rules', 'fx_rewrites.backends') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "loaded: []" in proc.stdout, proc.stdout
    assert ("fx-rewrites 0" in proc.stdout) if flag == "--version" else ("usage: fx-rewrites" in proc.stdout)


# ----------------------------------------------------------------------------- rules


def test_rules_lists_one_line_per_rule_under_its_phase(capsys):
    """`fx-rewrites rules --backend iree` printed ~480 lines with no one-line view; --long is that view now."""
    code, out, _ = _run(capsys, "rules", "--backend", "iree")
    assert code == 0
    rules = backends.get("iree").rules
    lines = out.splitlines()
    assert [line for line in lines if line.startswith("# ")] == [f"# {s.name}: {len(s)} rules" for s in rules.sets]
    listed = [line.split()[0] for line in lines if not line.startswith("# ")]
    assert listed == rules.names()
    assert re.search(r"^lift_fresh_copy_to_clone +aten\.lift_fresh_copy\.default$", out, flags=re.M)
    assert len(lines) == len(rules) + len(rules.sets) and max(map(len, lines)) <= 100


def test_rules_summarises_long_root_lists(capsys):
    code, out, _ = _run(capsys, "rules", "--backend", "iree", "--long")
    assert code == 0
    rules = {r.name: r for r in backends.get("iree").rules}
    assert "decompose_for_iree" in out  # the backend's own pack, not only DEFAULT
    roots = dict(re.findall(r"^(\w+)  \(priority -?\d+\)\n  roots: (.*)$", out, flags=re.M))
    assert set(roots) == set(rules)
    n = len(rules["sym_scalar_in_tensor_slot"].roots)
    assert re.fullmatch(
        rf"aten\.add/sub/[\w/]+/\.\.\. \({n} overloads of \d+ ops\)", roots["sym_scalar_in_tensor_slot"]
    )
    assert roots["lift_fresh_copy_to_clone"] == "aten.lift_fresh_copy.default"
    assert max(len(line) for line in out.splitlines()) <= 120
    code, out, _ = _run(capsys, "rules", "--backend", "iree", "--verbose")
    assert "aten.addcdiv.default" in out  # every overload


# ----------------------------------------------------------------------------- explain


def test_explain_text_shows_provenance_and_near_misses(files, capsys):
    code, out, err = _run(capsys, "explain", f"{files['model']}:make")
    assert code == 0, out + err
    assert "~ max_pool2d " in out and "# rewritten by pool_stride_defaults" in out
    assert "- detach_ " in out and "# removed by drop_detach_" in out
    assert re.search(
        r"\+ max_pool2d_1 +aten\.max_pool2d\.default\(x, \[2, 2\], \[2, 2\], \[0, 0\], \[1, 1\], False\)", out
    )
    assert "# pool_stride_defaults from max_pool2d" in out  # provenance of the new node
    assert "lift_fresh_copy_to_clone  lift_fresh_copy (aten.lift_fresh_copy.default) -> clone" in out
    # the near-miss reason is the rule's own, as Report.explain() records it
    module, args = _factory_from_source()
    ep = torch.export.export(module, args)
    result = fx_rewrites.apply(ep, backends.get("iree").rules, explain=True)
    reason = result.report.explain("sym_scalar_in_tensor_slot")[0].reason
    assert f"  sym_scalar_in_tensor_slot: {reason}\n      on add (aten.add.Tensor)" in out


def test_explain_one_rule(files, capsys):
    code, out, _ = _run(capsys, "explain", files["pt2"], "--rule", "sym_scalar_in_tensor_slot")
    assert code == 0
    assert "near-misses of sym_scalar_in_tensor_slot:" in out and "on add (aten.add.Tensor)" in out
    assert "none by sym_scalar_in_tensor_slot" in out  # it rewrote nothing
    code, _, err = _run(capsys, "explain", files["pt2"], "--rule", "no_such_rule")
    assert code == 2 and "no rule named 'no_such_rule'" in err and "Fix: name one of the" in err
    assert "`fx-rewrites rules --backend iree` lists them all" in err and "pool_stride_defaults" not in err
    code, _, err = _run(capsys, "explain", files["pt2"], "--rule", "pool_stride")  # a near miss: suggested
    assert code == 2 and "Fix: did you mean 'pool_stride_defaults'?" in err
    code, _, err = _run(capsys, "explain", files["pt2"], "--rule", "lift_fresh_to_clone")
    assert "did you mean 'lift_fresh_copy_to_clone'" in err


class _Page(html.parser.HTMLParser):
    """The graphs table of an explain page: rows of (class, [(cell class, style, text)])."""

    def __init__(self) -> None:
        super().__init__()
        self.in_graphs = False
        self.rows: list[tuple[str, list[list[str]]]] = []
        self.cell: list[str] | None = None
        self.tags: set[str] = set()
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        if tag == "table" and "graphs" in (a.get("class") or ""):
            self.in_graphs = True
        elif self.in_graphs and tag == "tr":
            self.rows.append((a.get("class") or "", []))
        elif self.in_graphs and tag == "td":
            self.cell = [a.get("class") or "", a.get("style") or "", ""]
            self.rows[-1][1].append(self.cell)

    def handle_endtag(self, tag):
        if tag == "table":
            self.in_graphs = False
        elif tag == "td":
            self.cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self.cell is not None:
            self.cell[2] += data


def test_explain_html_page(files, capsys, tmp_path):
    page_path = tmp_path / "net.html"
    code, out, err = _run(capsys, "explain", f"{files['model']}:make", "--html", page_path)
    assert code == 0, out + err
    assert f"wrote {page_path}" in out
    page = page_path.read_text()
    # self-contained: no scripts, no external assets
    assert "<script" not in page and "<link" not in page and "src=" not in page and "url(" not in page
    parsed = _Page()
    parsed.feed(page)
    # rows: before (name, op, value), the rule, after (name, op, value); a side with no node is one empty cell
    by_before = {cells[0][2]: (cls, cells) for cls, cells in parsed.rows if len(cells) == 7}
    assert {"x", "max_pool2d", "lift_fresh_copy", "add", "output"} <= set(by_before)
    # a rewritten node, the rule that did it, and what it became, tinted with that rule's colour
    cls, cells = by_before["max_pool2d"]
    assert "rewritten" in cls and "new" in cls
    before, gutter, after = cells[0], cells[3], cells[4]
    assert "pool_stride_defaults" in gutter[2]
    assert after[2] == "max_pool2d_1from max_pool2d"
    assert "background:" in before[1] and "background:" in after[1]
    removed = [(cls, cells) for cls, cells in parsed.rows if cells and cells[0][2] == "detach_"]
    assert len(removed) == 1 and "removed" in removed[0][0] and "drop_detach_" in removed[0][1][3][2]
    assert "empty" in removed[0][1][4][0]  # nothing on the after side
    cls, cells = by_before["add"]
    assert not cells[0][1] and cells[5][2] == "aten.add.Tensor(max_pool2d_1, view)"  # kept, reads the new node
    text = "".join(parsed.text)
    assert "Before (8 nodes)" in text and "After the rules (7 nodes)" in text
    assert "Near-misses" in text and "sym_scalar_in_tensor_slot" in text


def test_explain_html_page_renders_in_chromium(files, capsys, tmp_path):
    """The page as a browser draws it: 1400x900, not blank."""
    chromium = _chromium()
    page_path = tmp_path / "net.html"
    code, out, err = _run(capsys, "explain", f"{files['model']}:make", "--html", page_path)
    assert code == 0, out + err
    _screenshot(chromium, page_path, tmp_path)


class _Deep(torch.nn.Module):
    """Twelve Linear layers (24 parameter inputs) and one buffer ahead of the one node the rules rewrite."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(12))
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return torch.nn.functional.max_pool1d(x.unsqueeze(0), 2) * self.scale


def test_html_folds_unchanged_parameters_and_links_each_rewritten_node():
    torch.manual_seed(0)
    ep = torch.export.export(_Deep().eval(), (torch.randn(2, 8),))
    rules = backends.get("iree").rules
    e = rx.explanation(ep, fx_rewrites.apply(ep, rules, explain=True), rules, title="deep", backend="iree")
    page = rx.render_html(e)
    rows = re.findall(r'<tr(?: id="(row-\d+)")? class="([^"]*)">(.*?)</tr>', page, flags=re.S)
    state = [body for _, cls, body in rows if "state" in cls.split()]
    # the 25 state inputs are folded (hidden by the CSS until "show" is ticked), the user input is not
    assert len(state) == 25 and all(re.search(r'class="kind">(parameter|buffer) ', b) for b in state)
    assert '<tr class="state-fold"><td colspan="7"><label for="show-state">25 unchanged' in page
    assert "#show-state:not(:checked) ~ .card tr.state{display:none}" in page
    assert "#changed-only:checked ~ .card tr.same{display:none}" in page
    assert page.index('id="changed-only"') < page.index('<table class="graphs">')  # a sibling before the table
    # unchanged rows are marked so the filter can hide them; the rewritten node and its rewired user are not
    changed = [body for _, cls, body in rows if "same" not in cls.split() and "state-fold" not in cls]
    assert len(changed) == 2 and ">max_pool1d<" in changed[0] and ">mul<" in changed[1]
    (rewritten,) = [(row_id, body) for row_id, cls, body in rows if "rewritten" in cls.split()]
    assert rewritten[0] and ">max_pool1d<" in rewritten[1]
    # the jump links and the rewrites table point at that row
    links = re.findall(r'<a href="#(row-\d+)">([^<]*)</a>', page)
    assert links and all(target == rewritten[0] and name == "max_pool1d" for target, name in links)
    assert len(links) == 2  # "jump to a rewritten node" and the rewrites table


def test_html_escapes_names_and_reasons():
    module, args = _factory_from_source()
    ep = torch.export.export(module, args)
    result = fx_rewrites.apply(ep, backends.get("iree").rules, explain=True)
    for node in result.graph_module.graph.nodes:
        if node.name == "clone":
            node.name = "clone<img src=x onerror=alert(1)>&"
    e = rx.explanation(ep, result, backends.get("iree").rules, title="<b>model</b>", backend="iree")
    e = attrs.evolve(e, near_misses=(rx.NearMiss("r", "dtype <class 'float'> & co", (("n", "op"),)),))
    page = rx.render_html(e)
    assert "<img" not in page and "<b>model" not in page and "<class" not in page
    assert "clone&lt;img src=x onerror=alert(1)&gt;&amp;" in page
    assert "&lt;b&gt;model&lt;/b&gt;" in page and "dtype &lt;class &#x27;float&#x27;&gt; &amp; co" in page
    assert "clone<img" in rx.render_text(e)  # text is for a terminal: as is


def _factory_from_source():
    namespace: dict = {}
    exec(MODEL, namespace)
    return namespace["make"]()


# ----------------------------------------------------------------------------- the page in a browser


def _chromium() -> str:
    """Headless Chromium renders the explain page: where it is missing the test skips, or fails in CI."""
    return require_program("chromium", "chromium-browser", hint="`apt-get install -y chromium` (Debian; .ci/run does)")


def _screenshot(chromium: str, page: Path, tmp_path: Path) -> None:
    png = tmp_path / "page.png"
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        f"--screenshot={png}",
        "--window-size=1400,900",
        page.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and png.is_file(), proc.stderr[-2000:]
    assert png.stat().st_size > 20_000  # a blank 1400x900 page is a few kB
    width, height, pixels = _decode_png(png.read_bytes())
    assert (width, height) == (1400, 900)
    background = pixels[0]
    differing = sum(p != background for p in pixels) / len(pixels)
    assert len(set(pixels)) > 50 and differing > 0.05, (len(set(pixels)), differing)


def _decode_png(data: bytes) -> tuple[int, int, list[tuple[int, ...]]]:
    """Width, height and every pixel of an 8-bit RGB/RGBA PNG (what Chromium writes), with PIL when present."""
    try:
        import io

        from PIL import Image

        image = Image.open(io.BytesIO(data)).convert("RGBA")
        return image.width, image.height, list(image.getdata())
    except ImportError:
        pass
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, chunks = 8, {}
    idat = b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IDAT":
            idat += body
        else:
            chunks.setdefault(kind, body)
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert depth == 8 and colour in (2, 6) and interlace == 0, "only 8-bit RGB(A), non-interlaced"
    bpp = 4 if colour == 6 else 3
    raw, stride = zlib.decompress(idat), width * bpp
    rows, prev = [], bytearray(stride)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = line
    pixels = [tuple(row[i : i + bpp]) for row in rows for i in range(0, stride, bpp)]
    return width, height, pixels
