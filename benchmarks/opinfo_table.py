"""The OpInfo corpus's results (JSON lines from `opinfo_corpus.py`) as docs/opinfo.md: counts, then one row per op."""

from __future__ import annotations

import platform
import re
import time
from collections import Counter, defaultdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

VARIANTS = ("static", "dynamic")
#: statuses a sample can have before IREE is tried (torch's side: not counted as IREE failures)
NOT_COMPARED = {
    "export": "torch.export fails",
    "random": "random (eager differs between seeds)",
    "eager-error": "eager fails on the sample",
    "static-only": "export specialised every dim",
    "uninitialised": "returns uninitialised memory (aten.empty*)",
}


def uninitialised(record: dict[str, Any]) -> bool:
    """The graph allocates without writing (aten.empty*, new_empty*): torch has no tag for it, so by name."""
    return any(op.startswith(("aten.empty", "aten.new_empty")) for op in record.get("ops", []))


def _checked(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("status") == "checked" and not uninitialised(r)]


def regressions(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples that pass as exported and fail after the rules."""
    return [
        r for r in _checked(records) if r.get("exported", {}).get("status") == "pass" and r["after"]["status"] != "pass"
    ]


def apply_crashes(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Samples on which `apply` raised something other than a named decline (a RewriteError)."""
    return [r for r in _checked(records) if r["after"]["status"] == "apply-crash"]


def _cell(samples: list[dict[str, Any]], column: str) -> str:
    """One op's column over its samples: "pass", or the first failure with how many samples passed."""
    if not samples:
        return "-"
    checked = _checked(samples)
    if not checked:
        status = "uninitialised" if uninitialised(samples[0]) else samples[0].get("status", "?")
        return {"static-only": "static only"}.get(status, status)
    states = [r.get(column, {}).get("status", "?") for r in checked]
    passed = states.count("pass")
    if passed == len(states):
        return "pass"
    first = next(s for s in states if s != "pass")
    return f"{first} ({passed}/{len(states)})" if passed else first


_LOCATION = re.compile(r" at (<unknown>|/\S+)(:\d+)+")


def _why(samples: list[dict[str, Any]]) -> str:
    for column in ("after", "exported"):
        for r in _checked(samples):
            state = r.get(column, {})
            if state.get("status", "pass") != "pass":
                why = state.get("why", "")
                why = why.split(". Hint:")[0].replace("IreeCompileError: IREE could not compile ", "")
                return _LOCATION.sub("", why).replace("|", "/")[:160]
    if _checked(samples):
        return ""
    for r in samples:
        if r.get("status") in NOT_COMPARED or r.get("status") == "timeout":
            return r.get("why", "").replace("|", "/").replace("\n", " ")[:160]
    return ""


def _fired(samples: list[dict[str, Any]]) -> str:
    rules = sorted({name for r in samples for name in r.get("fired", {})})
    return ", ".join(rules)


def _tally(by_op: dict[str, dict[str, list[dict[str, Any]]]], variant: str) -> dict[str, Any]:
    """Per-op counts for one variant."""
    counts: Counter[str] = Counter()
    for per_variant in by_op.values():
        samples = per_variant.get(variant, [])
        if not _checked(samples):
            counts["not compared"] += 1
            continue
        counts["compared"] += 1
        exported, after = _cell(samples, "exported") == "pass", _cell(samples, "after") == "pass"
        counts["pass as exported"] += exported
        counts["pass after rules"] += after
        counts["fixed by the rules"] += after and not exported
        counts["fail after rules"] += not after
    return counts


def summary_lines(records: list[dict[str, Any]], all_ops: list[str]) -> list[str]:
    by_op: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if "sample" in r:
            by_op[r["op"]][r["variant"]].append(r)
    checked = _checked(records)
    lines = [
        f"- OpInfo entries: {len(all_ops)}; run: {len(by_op)}; samples checked on IREE: {len(checked)} "
        f"({sum(r['variant'] == 'static' for r in checked)} static, {sum(r['variant'] == 'dynamic' for r in checked)} "
        "dynamic)",
    ]
    for variant in VARIANTS:
        c = _tally(by_op, variant)
        lines.append(
            f"- {variant}: {c['compared']} ops compared; pass as exported {c['pass as exported']}, "
            f"after the rules {c['pass after rules']} (fixed by the rules: {c['fixed by the rules']}); "
            f"fail after the rules {c['fail after rules']}; not compared {c['not compared']}"
        )
    after = Counter(r["after"]["status"] for r in checked)
    lines.append("- samples after the rules, by outcome: " + ", ".join(f"{k} {v}" for k, v in after.most_common()))
    skipped = Counter(
        "uninitialised" if uninitialised(r) else r.get("status")
        for r in records
        if "sample" in r and (r.get("status") != "checked" or uninitialised(r))
    )
    lines.append("- samples not compared: " + (", ".join(f"{k} {v}" for k, v in skipped.most_common()) or "none"))
    reg, crash = regressions(records), apply_crashes(records)
    declined = [r for r in checked if r["after"]["status"] == "apply-declined"]
    lines.append(f"- **pass as exported, fail after the rules: {len(reg)}** (samples)")
    lines.extend(f"  - {r['op']} sample {r['sample']} {r['variant']}: {r['after'].get('why', '')[:200]}" for r in reg)
    lines.append(f"- `apply` errors: {len(declined)} named declines, **{len(crash)} crashes**")
    lines.extend(f"  - {r['op']} sample {r['sample']} {r['variant']}: {r['after'].get('why', '')[:200]}" for r in crash)
    wrong = sorted({r["op"] for r in checked if r["after"]["status"] == "wrong"})
    lines.append(f"- ops that run on IREE after the rules and differ from eager: {len(wrong)}: {', '.join(wrong)}")
    return lines


def write(records: list[dict[str, Any]], all_ops: list[str], path: Path, *, samples: int) -> str:
    """Write the table to `path`; returns the counts as text."""
    by_op: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    dtypes: dict[str, str] = {}
    for r in records:
        if "sample" in r:
            by_op[r["op"]][r["variant"]].append(r)
            dtypes.setdefault(r["op"], r.get("dtype", ""))
    summary = summary_lines(records, all_ops)
    rows = []
    for key in sorted(by_op):
        per = by_op[key]
        cells = [
            key,
            dtypes.get(key, "").replace("torch.", ""),
            _cell(per["static"], "exported"),
            _cell(per["static"], "after"),
            _cell(per["dynamic"], "exported"),
            _cell(per["dynamic"], "after"),
            _fired(per["static"] + per["dynamic"]),
            _why(per["static"] + per["dynamic"]),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    versions = f"torch {version('torch')}, iree-base-compiler {version('iree-base-compiler')}"
    text = "\n".join(
        [
            "# torch's OpInfo ops on IREE, as exported and after the rules",
            "",
            f"Generated by `python benchmarks/opinfo_corpus.py` ({versions}, llvm-cpu on {platform.machine()}, "
            f"{time.strftime('%Y-%m-%d')}). Each OpInfo op's first {samples} sample inputs (CPU; float32, else the "
            "first of int64, int32, bool, float64 it supports; samples with empty or sparse tensors last), exported "
            "statically and with every dim `Dim.AUTO` (dynamic: only where export keeps a dim dynamic), compiled on "
            "IREE as exported and after `fx_rewrites.apply(ep, backend.rules)`, run, compared with eager "
            "(rtol 1e-3, atol 1e-4). A cell is `pass` when every sample passes, else the first failure "
            "(with k/n samples passing): `compile` (iree-compile), `import` (the FX importer), `run` (the "
            "runtime), `wrong` (runs, differs from eager), `apply-declined` (a named `apply` error). "
            "`export`, `random`, `eager-error` and `static only` are torch's side: not compared. "
            "`tests/corpus` runs a fixed sample of this in CI.",
            "",
            "## Counts",
            "",
            *summary,
            "",
            "## Per op",
            "",
            "| op | dtype | static, as exported | static, after rules | dynamic, as exported | dynamic, after rules "
            "| rules fired | why (first failure after the rules, else as exported) |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    path.write_text(text)
    return "\n".join(summary)
