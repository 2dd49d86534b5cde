"""torch's OpInfo database as an op-level corpus for the IREE backend.

Each OpInfo op (`torch.testing._internal.common_methods_invocations.op_db`)
is exported op by op on its first sample inputs (CPU, float32, or the first
dtype of `opinfo_cases.DTYPES` it supports), statically and with every dim
`Dim.AUTO` (where export keeps one dynamic), compiled on IREE as exported and
after `fx_rewrites.apply(ep, backend.rules)`, and compared with eager.

    python benchmarks/opinfo_corpus.py [--ops mul,xlogy] [--samples 3] [--jobs 2] [--fresh]
    python benchmarks/opinfo_corpus.py --table-only      # rewrite docs/opinfo.md from the results

Results go to a JSON-lines file (`--results`, default .corpus/opinfo.jsonl),
one line per (op, sample, variant), appended as they come: a run that is
stopped resumes where it was (`--fresh` starts over; `--rerun OPS` re-checks
some ops). Checks run in `--jobs` worker processes, each in its own process
group, killed with its iree-compile after `--timeout` seconds on one check.
IREE compiles are cached on disk (`--cache`, default .corpus/iree-cache), so a
re-run recompiles only graphs that changed. At the end the table and its
counts are written to `--table` (default docs/opinfo.md); the exit status is
1 when a sample passes as exported and fails after the rules, or when
`apply` raised something other than a named decline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import opinfo_table  # noqa: E402


def _worker(conn: Connection, cache: str, samples: int, log: str) -> None:
    """Check ops as the parent sends their keys; ("start", i, variant) before each check, then its record."""
    os.setsid()  # the parent kills the whole group, iree-compile included
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["FX_REWRITES_IREE_CACHE"] = cache
    import torch

    torch.set_num_threads(1)
    import opinfo_cases

    from fx_rewrites import backends

    ops = opinfo_cases.load_ops()
    backend = backends.get("iree")
    conn.send(("ready",))
    while (task := conn.recv()) is not None:
        key, skip = task
        op = ops[key]
        dtype = opinfo_cases.pick_dtype(op)
        for index, variant, thunk in opinfo_cases.iter_checks(op, samples, backend, backend.rules, set(skip)):
            conn.send(("start", index, variant))
            try:
                record = thunk()
            except Exception as e:  # the corpus's own bug; keep going
                record = {"variant": variant, "status": "harness-error", "why": f"{type(e).__name__}: {e}"[:300]}
            conn.send(("record", {"op": key, "dtype": str(dtype), "sample": index, **record}))
        conn.send(("done",))


class Worker:
    def __init__(self, ctx: Any, args: argparse.Namespace, number: int) -> None:
        self.conn, child = ctx.Pipe()
        log = str(Path(args.results).with_suffix(f".worker{number}.log"))
        self.process = ctx.Process(target=_worker, args=(child, args.cache, args.samples, log), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.task: tuple[str, list[tuple[int, str]]] | None = None
        self.current: tuple[int, str] | None = None
        self.deadline = float("inf")

    def send(self, key: str, skip: list[tuple[int, str]], timeout: float) -> None:
        self.task = (key, skip)
        self.current = None
        self.deadline = time.monotonic() + timeout
        self.conn.send(self.task)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.join(5)


def _load(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return records


def run(args: argparse.Namespace, keys: list[str]) -> None:
    results = Path(args.results)
    records = _load(results)
    done_ops = {r["op"] for r in records if r.get("done")}
    done_checks: dict[str, list[tuple[int, str]]] = {}
    for r in records:
        if "sample" in r:
            done_checks.setdefault(r["op"], []).append((r["sample"], r["variant"]))
    todo = deque(k for k in keys if k not in done_ops)
    print(f"{len(todo)} ops to check ({len(keys) - len(todo)} already done) with {args.jobs} workers", flush=True)
    if not todo:
        return
    ctx = multiprocessing.get_context("spawn")
    out = results.open("a")

    def write(record: dict[str, Any]) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    workers = [Worker(ctx, args, i) for i in range(min(args.jobs, len(todo)))]
    started, finished = time.monotonic(), 0
    while todo or any(w.task for w in workers):
        for w in workers:
            if w.ready and w.task is None and todo:
                key = todo.popleft()
                w.send(key, done_checks.get(key, []), args.timeout)
        ready = wait([w.conn for w in workers], timeout=5)
        for i, w in enumerate(workers):
            lost = False
            if w.conn in ready:
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):
                    lost, why = True, f"worker died (exit code {w.process.exitcode}): a crash or out of memory"
                else:
                    kind = message[0]
                    if kind == "ready":
                        w.ready = True
                    elif kind == "start":
                        w.current = (message[1], message[2])
                        w.deadline = time.monotonic() + args.timeout
                    elif kind == "record":
                        write(message[1])
                        done_checks.setdefault(message[1]["op"], []).append(w.current)
                    elif kind == "done":
                        key = w.task[0]
                        write({"op": key, "done": True})
                        finished += 1
                        elapsed = time.monotonic() - started
                        print(f"[{finished}/{len(keys)}] {key} ({elapsed:.0f} s)", flush=True)
                        w.task = None
            elif w.task is not None and time.monotonic() > w.deadline:
                lost, why = True, f"timeout: no result after {args.timeout:.0f} s"
            if lost:
                w.kill()
                if w.task is not None:
                    key = w.task[0]
                    if w.current is not None:
                        index, variant = w.current
                        write({"op": key, "sample": index, "variant": variant, "status": "timeout", "why": why})
                        done_checks.setdefault(key, []).append(w.current)
                        todo.appendleft(key)  # the op's other samples
                    else:
                        write({"op": key, "done": True, "why": why})
                workers[i] = Worker(ctx, args, i)
    for w in workers:
        w.conn.send(None)
        w.process.join(10)
    out.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (name.variant); default: all")
    parser.add_argument("--samples", type=int, default=4, help="sample inputs per op")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one check")
    parser.add_argument("--results", default=str(ROOT / ".corpus" / "opinfo.jsonl"))
    parser.add_argument("--cache", default=str(ROOT / ".corpus" / "iree-cache"))
    parser.add_argument("--table", default=str(ROOT / "docs" / "opinfo.md"))
    parser.add_argument("--fresh", action="store_true", help="forget earlier results")
    parser.add_argument("--rerun", default="", help="comma-separated ops whose earlier results are dropped")
    parser.add_argument("--table-only", action="store_true", help="write the table from the results only")
    args = parser.parse_args(argv)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        results.unlink(missing_ok=True)
    if args.rerun:
        drop = set(args.rerun.split(","))
        kept = [r for r in _load(results) if r["op"] not in drop]
        results.write_text("".join(json.dumps(r) + "\n" for r in kept))
    import opinfo_cases

    every = opinfo_cases.load_ops()
    keys = args.ops.split(",") if args.ops else list(every)
    unknown = [k for k in keys if k not in every]
    if unknown:
        parser.error(f"no OpInfo named {unknown}")
    if not args.table_only:
        run(args, keys)
    summary = opinfo_table.write(_load(results), list(every), Path(args.table), samples=args.samples)
    print(summary)
    return 1 if opinfo_table.regressions(_load(results)) or opinfo_table.apply_crashes(_load(results)) else 0


if __name__ == "__main__":
    sys.exit(main())
