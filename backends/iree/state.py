"""A program's state (the buffers and parameters it writes) kept in the IREE module as mutable globals.

`lift_state` takes the state arguments and writes out of a call plan; `import_mlir` imports the program
as the private `main$body` and `wrap_state` writes the public `main` around it: each state argument loaded
from its global (initialised from the parameter of its name, or inline), each new value stored back, the
user's arguments and results passed through. Calls then advance the state inside the module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.export import ExportedProgram

from fx_rewrites.backends.convention import Output, Plan


def state_tensor(program: ExportedProgram, target: str) -> torch.Tensor:
    """The tensor `target` names among `program`'s state and lifted constants."""
    return program.state_dict[target] if target in program.state_dict else program.constants[target]


@dataclasses.dataclass(frozen=True)
class StateGlobals:
    """Mutated buffers and parameters kept in the module as mutable globals, not passed by the caller.

    `reads`: (position among the imported function's arguments, state key); `writes`: (position among its
    results, state key); `tensors`: key -> the tensor that gives the global its initial value.
    """

    reads: tuple[tuple[int, str], ...]
    writes: tuple[tuple[int, str], ...]
    tensors: Mapping[str, torch.Tensor]


def lift_state(program: ExportedProgram, plan: Plan) -> tuple[Plan, StateGlobals | None]:
    """`plan` (from `prepare_program`) without its state arguments and state writes, and where they went
    (None, and `plan` as is, for a program that mutates no buffer or parameter).

    The imported function still takes the state as arguments and returns its new values;
    `import_mlir(..., state=...)` wraps it in a `main` that loads them from mutable globals and stores them back.
    """
    keys = {id(t): k for k, t in (*program.constants.items(), *program.state_dict.items())}
    reads = tuple((i, keys[id(a)]) for i, a in enumerate(plan.args) if isinstance(a, torch.Tensor))
    if not reads and not any(isinstance(o.write, torch.Tensor) for o in plan.outputs):
        return plan, None
    writes, outputs, kept = [], [], 0
    for out in plan.outputs:
        if isinstance(out.write, torch.Tensor):
            writes.append((out.result, keys[id(out.write)]))
            continue
        if out.result is None:
            outputs.append(out)
        else:
            outputs.append(Output(kept, out.constant, out.dtype, out.write))
            kept += 1
    tensors = {k: state_tensor(program, k) for k in dict.fromkeys([k for _, k in reads] + [k for _, k in writes])}
    lifted = Plan(
        plan.in_spec,
        plan.out_spec,
        tuple(a for a in plan.args if not isinstance(a, torch.Tensor)),
        tuple(outputs),
        plan.inputs,
        plan.ranges,
    )
    return lifted, StateGlobals(reads, tuple(writes), tensors)


#: the imported function of a program with state (`import_mlir`); `main` wraps it
BODY = "main$body"


def body_name(name: str) -> str:
    """The private function a public function `name` with state wraps (`main$body` for `main`)."""
    return f"{name}$body"


def wrap_state(ir: Any, importer: Any, body: Any, state: StateGlobals, hooks: Any, name: str = "main") -> Any:
    """A public `name` around the private `body` (`body_name(name)`): state arguments loaded from mutable
    globals, state results stored back to them, the user's arguments and results passed through in order.
    Functions of one module that name the same state key share its global (`hooks.state_global`)."""
    callee = body_name(name)
    ftype = ir.FunctionType(ir.TypeAttr(body.attributes["function_type"]).value)
    inputs, results = list(ftype.inputs), list(ftype.results)
    symbols = {key: hooks.state_global(key, tensor) for key, tensor in state.tensors.items()}
    reads, writes = dict(state.reads), dict(state.writes)
    lines, params, operands = [], [], []
    for i, vtype in enumerate(inputs):
        if i in reads:
            symbol, builtin = symbols[reads[i]]
            lines.append(f"%s{i} = util.global.load @{symbol} : {builtin}")
            lines.append(f"%v{i} = torch_c.from_builtin_tensor %s{i} : {builtin} -> {vtype}")
            operands.append(f"%v{i}")
        else:
            params.append(f"%a{i}: {vtype}")
            operands.append(f"%a{i}")
    call = f"({', '.join(operands)}) : ({', '.join(map(str, inputs))}) -> ({', '.join(map(str, results))})"
    lines.append(f'{"%r:" + str(len(results)) + " = " if results else ""}func.call @"{callee}"{call}')
    returned = []
    for j, vtype in enumerate(results):
        if j in writes:
            symbol, builtin = symbols[writes[j]]
            lines.append(f"%b{j} = torch_c.to_builtin_tensor %r#{j} : {vtype} -> {builtin}")
            lines.append(f"util.global.store %b{j}, @{symbol} : {builtin}")
        else:
            returned.append((f"%r#{j}", str(vtype)))
    user_results = ", ".join(t for _, t in returned)
    ret = f"func.return {', '.join(v for v, _ in returned)} : {user_results}" if returned else "func.return"
    head = f"func.func @{name}({', '.join(params)}) -> ({user_results})"
    text = f"{head} attributes {{torch.assume_strict_symbolic_shapes}} {{\n  " + "\n  ".join([*lines, ret]) + "\n}"
    # parsed (and verified) beside declarations of what it refers to, then moved into the module
    declarations = [f"util.global private mutable @{symbol} : {builtin}" for symbol, builtin in symbols.values()]
    declarations.append(f'func.func private @"{callee}"{call.split(" : ", 1)[1]}')
    scratch = ir.Module.parse("\n".join([*declarations, text]), context=importer._c)
    op = next(o for o in scratch.body.operations if ir.StringAttr(o.attributes["sym_name"]).value == name)
    op.detach_from_parent()
    ir.InsertionPoint(importer.module.body).insert(op)
    return op
