"""The worklist fixpoint driver.

Every call_function node starts on the worklist, in graph order. A node is
offered only the rules indexed under its target, highest priority first
(ties: the order the rules were given). When a rule fires, the nodes it
created, their operands and users are queued again; nothing else is
rescanned. The run stops at the fixpoint (empty worklist), at the rewrite
budget, or when a rewrite brings back a form the same rule already rewrote
on the same lineage (rules that undo each other).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import defaultdict, deque
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Literal

from torch.fx import Graph, Node

from fx_rewrites.engine import values
from fx_rewrites.engine.errors import NonConvergence, RuleError
from fx_rewrites.engine.protocol import Miss, Rule, is_miss, miss_reason
from fx_rewrites.engine.report import Attempt, Report, Skip
from fx_rewrites.engine.rewriter import CheckFailed, Rewriter

OnError = Literal["raise", "skip"]

#: rewrites allowed per node of the input graph (plus a floor for tiny graphs).
BUDGET_PER_NODE = 8
BUDGET_FLOOR = 64
#: how deep a created node's arguments are expanded when comparing forms.
FORM_DEPTH = 3


def index_rules(rules: Iterable[Rule]) -> dict[Hashable, list[Rule]]:
    """Rules by root target, highest priority first, ties in given order."""
    ordered = sorted(enumerate(rules), key=lambda p: (-p[1].priority, p[0]))
    seen: set[str] = set()
    index: dict[Hashable, list[Rule]] = defaultdict(list)
    for _, rule in ordered:
        if rule.name in seen:
            raise ValueError(f"two rules are named {rule.name!r}; rule names must be unique")
        seen.add(rule.name)
        if not rule.roots:
            raise ValueError(f"rule {rule.name!r} has no roots; the engine cannot index it")
        for root in rule.roots:
            index[root].append(rule)
    return dict(index)


#: recent rule lists' indexes keyed by the rules' ids (each entry holds its rules, so those ids stay
#: theirs, and the roots it was built from): a rule rooted at every mutating ATen overload (1,537 roots)
#: makes DEFAULT's index cost ~1.5 ms to build, which a run on a small graph (one phase of a backend) would
#: otherwise pay every call
_INDEXES: dict[tuple[int, ...], tuple[tuple[Rule, ...], list[tuple[Hashable, ...]], dict[int, list[Rule]]]] = {}
_INDEXES_KEPT = 32


def _index_by_id(rules: Sequence[Rule]) -> dict[int, list[Rule]]:
    """`index_rules` keyed by id(target) (OpOverload.__hash__ is Python code), cached per rule list.

    A rule's roots may grow after the index was built (a root looked up when read, such as an op a
    library registers on first import), so every call reads them again and rebuilds the index when any
    differs: one attribute read per rule and a C comparison (~10 us for an IREE phase of 44 rules).
    """
    held = tuple(rules)
    key = tuple(map(id, held))
    roots = [rule.roots for rule in held]
    hit = _INDEXES.get(key)
    if hit is None or hit[1] != roots:
        _INDEXES.pop(key, None)
        while len(_INDEXES) >= _INDEXES_KEPT:
            _INDEXES.pop(next(iter(_INDEXES)))
        hit = _INDEXES[key] = (held, roots, {id(target): found for target, found in index_rules(held).items()})
    return hit[2]


class _Run:
    def __init__(self, graph: Graph, rules: Sequence[Rule], **opts: Any) -> None:
        self.graph = graph
        self.index = _index_by_id(rules)
        self.fake_mode = opts["fake_mode"]
        self.on_error: OnError = opts["on_error"]
        self.strict: bool = opts["strict"]
        self.explain: bool = opts["explain"]
        self.check_shapes: bool = opts["check_shapes"]
        n = len(graph.nodes)
        budget = opts["budget"]
        self.report = Report(
            budget=budget if budget is not None else BUDGET_PER_NODE * n + BUDGET_FLOOR,
            nodes_before=n,
            attempts=[] if self.explain else None,
        )
        self.queue: deque[Node] = deque()
        self.queued: set[Node] = set()
        self.origin: dict[Node, Node] = {}  # created node -> original node it descends from
        self.history: dict[Node, list[str]] = defaultdict(list)  # origin -> rules fired
        # (rule, origin, form) -> (its place in the origin's history, the rewrite count when it was rewritten)
        self.seen_forms: dict[tuple, tuple[int, int]] = {}
        self.born: dict[Node, int] = {}  # created node -> the rewrite count when it was made
        self.rewrites_done = 0
        self.skipped: set[tuple[str, Node]] = set()

    # -- worklist ---------------------------------------------------------------

    def push(self, nodes: Iterable[Node]) -> None:
        for node in nodes:
            if node.op == "call_function" and node not in self.queued and id(node.target) in self.index:
                self.queue.append(node)
                self.queued.add(node)

    def run(self) -> Report:
        start = time.perf_counter()
        self.push(self.graph.nodes)
        while self.queue:
            node = self.queue.popleft()
            self.queued.discard(node)
            if node._erased:
                continue
            self.report.visits += 1
            if not self.visit(node):
                break
        self.report.nodes_after = len(self.graph.nodes)
        self.report.total_seconds = time.perf_counter() - start
        return self.report

    def visit(self, node: Node) -> bool:
        """Offer `node` to its rules; False when the run must stop."""
        for rule in self.index[id(node.target)]:
            if self.skipped and (rule.name, node) in self.skipped:
                continue
            t0 = time.perf_counter()
            try:
                form = self.attempt(rule, node)
            finally:
                self.report.seconds[rule.name] += time.perf_counter() - t0
            if form is not None:
                return self.after_rewrite(rule, form)
        return True

    # -- one rule on one node ---------------------------------------------------

    def attempt(self, rule: Rule, node: Node) -> tuple | None:
        """Match and rewrite; returns (origin, form before, when the node was made) when it fired."""
        try:
            found = rule.match(node)
        except Exception as e:
            return self.failed(rule, node, f"match raised {type(e).__name__}: {e}", e)
        if is_miss(found):
            if self.report.attempts is not None:
                self.record(rule, node, False, miss_reason(found))
            return None
        rw = Rewriter(self.graph, node, rule.name, self.fake_mode, check_shapes=self.check_shapes)
        origin = self.origin.get(node, node)
        # the form is only needed once its origin was rewritten before: a
        # cycle then shows as a repeat, one round later than if every first
        # form were kept (most nodes are rewritten once; forms cost)
        form = self.form(node) if origin in self.history else None
        born = self.born.get(node, -1)
        try:
            answer = rule.rewrite(node, found, rw)
            if isinstance(answer, Miss):  # a rule may still decline while rewriting
                rw.rollback()
                self.record(rule, node, False, miss_reason(answer))
                return None
            touched = rw.commit()
        except CheckFailed as e:
            rw.rollback()
            return self.failed(rule, node, str(e), e, op=_op_label(node.target))
        except Exception as e:
            rw.rollback()
            return self.failed(rule, node, f"{type(e).__name__}: {e}", e, op=_op_label(node.target))
        except BaseException:
            rw.rollback()
            raise
        self.record(rule, node, True, "fired")
        if rw.notes:
            self.report.notes.extend(rw.notes)
        stamp = self.rewrites_done
        for created in rw.created:
            if not created._erased:
                self.origin[created] = origin
                self.born[created] = stamp
        self.push(touched)
        if not node._erased:
            self.push((node,))
        return origin, form, born

    def failed(self, rule: Rule, node: Node, cause: str, exc: BaseException, op: str = "") -> None:
        if self.on_error == "raise":
            raise RuleError(rule.name, node.name, cause, op=op) from exc
        self.skipped.add((rule.name, node))
        self.report.skips.append(Skip(rule.name, node.name, cause))
        self.record(rule, node, False, f"skipped: {cause}")
        return None

    def record(self, rule: Rule, node: Node, fired: bool, reason: str) -> None:
        if self.report.attempts is not None:
            self.report.attempts.append(Attempt(rule.name, node.name, _op_label(node.target), fired, reason))

    # -- termination ------------------------------------------------------------

    def after_rewrite(self, rule: Rule, fired: tuple) -> bool:
        report = self.report
        stamp = self.rewrites_done
        self.rewrites_done += 1
        report.rewrites[rule.name] += 1
        origin, form, born = fired
        history = self.history[origin]
        key = (rule.name, origin, form)
        seen = self.seen_forms.get(key) if form is not None else None
        # a repeat is a cycle only when this node was made after that form was rewritten: two equal nodes that
        # one decomposition made side by side (`total != 0` written twice) are each rewritten once
        if seen is not None and born >= seen[1]:
            cycle = list(dict.fromkeys(history[seen[0] :] + [rule.name]))
            if len(cycle) == 1:
                why = f"rule {cycle[0]!r} keeps rewriting the same form of node {origin.name!r}"
            else:
                names = ", ".join(repr(c) for c in cycle[:-1]) + f" and {cycle[-1]!r}"
                why = f"rules {names} undo each other on node {origin.name!r}"
            return self.stop(f"non-convergence: {why}")
        if form is not None and seen is None:
            self.seen_forms[key] = (len(history), stamp)
        history.append(rule.name)
        if report.total_rewrites >= report.budget:
            busiest = ", ".join(f"{n!r} ({c})" for n, c in report.rewrites.most_common(3))
            return self.stop("rewrite budget", f"rewrite budget of {report.budget} used up; busiest rules: {busiest}")
        return True

    def stop(self, reason: str, detail: str | None = None) -> bool:
        self.report.stop_reason = reason
        if detail:
            self.report.notes.append(detail)
        if self.strict:
            raise NonConvergence(detail or reason.removeprefix("non-convergence: "))
        return False

    def form(self, node: Node, depth: int = FORM_DEPTH) -> tuple:
        """A hashable picture of `node`: its target and arguments, where an
        original node stands for itself and a created one for its own form."""

        def arg(a: Any) -> Hashable:
            if isinstance(a, Node):
                if a in self.origin and depth > 0:
                    return self.form(a, depth - 1)
                return a
            if isinstance(a, (list, tuple)):
                return tuple(arg(x) for x in a)
            if isinstance(a, dict):
                return tuple((k, arg(v)) for k, v in a.items())
            try:
                hash(a)
            except TypeError:
                return repr(a)
            return a

        return (node.target, arg(node.args), arg(node.kwargs))


@contextlib.contextmanager
def _gc_paused() -> Any:
    """Python's cyclic collector off for the run, and what the run made
    promoted to the oldest generation unscanned when it ends.

    A large graph is millions of objects in reference cycles (nodes, users,
    values) and every rewrite allocates: the collector rescanned them over
    and over (a third of DEFAULT's run on a 100k-node graph), and re-enabled
    it scans everything the run allocated at once. `gc.freeze()` then
    `gc.unfreeze()` moves every tracked object to the oldest generation
    without a scan; it is skipped when someone else froze objects (unfreeze
    would release theirs too). Garbage the run made in cycles is collected
    by the next full collection, as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()


def _op_label(target: Any) -> str:
    """ "aten.add.Tensor" for ATen ops, the function name otherwise."""
    return str(target) if hasattr(target, "_schema") else getattr(target, "__name__", repr(target))


def run(
    graph: Graph,
    rules: Sequence[Rule],
    *,
    fake_mode: Any = None,
    budget: int | None = None,
    on_error: OnError = "raise",
    strict: bool = False,
    explain: bool = False,
    check_shapes: bool = True,
    lint: bool = True,
) -> Report:
    """Rewrite `graph` in place with `rules` until nothing matches.

    `fake_mode` defaults to the one found on the placeholders' values. With
    `strict`, a run that stops short of the fixpoint raises NonConvergence;
    otherwise the report says why it stopped. `on_error` decides whether a
    failing rule raises RuleError or is skipped on that node.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if fake_mode is None:
        fake_mode = values.find_fake_mode(graph)
    values.adopt_constants(graph, fake_mode)
    with _gc_paused():
        report = _Run(
            graph,
            rules,
            fake_mode=fake_mode,
            budget=budget,
            on_error=on_error,
            strict=strict,
            explain=explain,
            check_shapes=check_shapes,
        ).run()
    if lint:
        graph.lint()
    return report
