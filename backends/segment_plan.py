"""A rank's plan, as data, and what runs it: device steps (the backend's compiled segments) between host steps
(collectives on torch.distributed). `segments.py` cuts a graph into a `Plan`; a saved module carries the plan as
JSON, so `load` needs no pickle.

    run = Segmented(plan, {name: compiled_segment, ...})
    run(*inputs)                               # segment 0 on the backend, all_reduce on the host, segment 1 ...
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from fx_rewrites.backends import collectives
from fx_rewrites.backends.collectives import HostCall, Ref


@attrs.frozen
class DeviceStep:
    """Call device function `function` with slots `inputs`; its outputs go to slots `outputs`."""

    function: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@attrs.frozen
class HostStep:
    """Run `calls` (collectives, their waits, getitems) on the host."""

    calls: tuple[HostCall, ...]


@attrs.frozen
class Plan:
    """Slots `inputs` take the flat inputs; `steps` run in order; `outputs` (a Ref, or a constant) are the
    flat outputs. `slots`: how many values a run holds."""

    inputs: tuple[int, ...]
    steps: tuple[DeviceStep | HostStep, ...]
    outputs: tuple[Any, ...]
    slots: int

    @property
    def functions(self) -> tuple[str, ...]:
        return tuple(s.function for s in self.steps if isinstance(s, DeviceStep))

    @property
    def collectives(self) -> int:
        """How many collectives a run makes (waits and getitems not counted)."""
        return sum(
            1
            for s in self.steps
            if isinstance(s, HostStep)
            for c in s.calls
            if c.op not in ("getitem", str(collectives.WAIT))
        )

    @property
    def host_round_trips(self) -> int:
        return sum(1 for s in self.steps if isinstance(s, HostStep))

    def to_json(self) -> str:
        steps = [
            {"device": s.function, "in": list(s.inputs), "out": list(s.outputs)}
            if isinstance(s, DeviceStep)
            else {"host": [c.to_json() for c in s.calls]}
            for s in self.steps
        ]
        outputs = [{"slot": o.slot} if isinstance(o, Ref) else {"const": o} for o in self.outputs]
        doc = {"inputs": list(self.inputs), "steps": steps, "outputs": outputs, "slots": self.slots}
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        doc = json.loads(text)
        steps: list[DeviceStep | HostStep] = []
        for s in doc["steps"]:
            if "device" in s:
                steps.append(DeviceStep(str(s["device"]), tuple(s["in"]), tuple(s["out"])))
            else:
                steps.append(HostStep(tuple(HostCall.from_json(c) for c in s["host"])))
        outputs = tuple(Ref(int(o["slot"])) if "slot" in o else o["const"] for o in doc["outputs"])
        return cls(tuple(doc["inputs"]), tuple(steps), outputs, int(doc["slots"]))


@attrs.define(eq=False)
class Segmented:
    """Runs a plan: device steps call `functions[name]` (the backend's compiled segments; each takes its
    inputs and returns a tuple or list), host steps run the collectives on torch.distributed.

    Called with the flat inputs; returns the flat outputs (`spec`: unflattened with that tree).
    `host_seconds` / `host_cpu_seconds` add up the wall and CPU time spent in host steps (the collectives)."""

    plan: Plan
    functions: Mapping[str, Callable[..., Any]] = attrs.field(repr=False)
    spec: pytree.TreeSpec | None = attrs.field(default=None, repr=False)
    host_seconds: float = 0.0
    host_cpu_seconds: float = 0.0
    calls: int = 0

    def run(self, flat: list[Any] | tuple[Any, ...]) -> list[Any]:
        plan = self.plan
        values: list[Any] = [None] * plan.slots
        for slot, value in zip(plan.inputs, flat, strict=True):
            values[slot] = value
        host_wall = host_cpu = 0.0
        with torch.no_grad():
            for step in plan.steps:
                if isinstance(step, DeviceStep):
                    out = self.functions[step.function](*(values[i] for i in step.inputs))
                    if isinstance(out, torch.Tensor):
                        out = (out,)
                    for slot, value in zip(step.outputs, out, strict=True):
                        values[slot] = value
                else:
                    wall, cpu = time.perf_counter(), time.process_time()
                    for call in step.calls:
                        call.run(values)
                    host_wall += time.perf_counter() - wall
                    host_cpu += time.process_time() - cpu
        self.host_seconds += host_wall
        self.host_cpu_seconds += host_cpu
        self.calls += 1
        return [values[o.slot] if isinstance(o, Ref) else o for o in plan.outputs]

    def __call__(self, *flat: Any) -> Any:
        out = self.run(flat)
        return pytree.tree_unflatten(out, self.spec) if self.spec is not None else out

    def release(self) -> None:
        for fn in self.functions.values():
            release = getattr(fn, "release", None)
            if callable(release):
                release()


__all__ = ["DeviceStep", "HostStep", "Plan", "Segmented"]
