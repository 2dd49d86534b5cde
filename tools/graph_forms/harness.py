"""Shared harness: run a module through every entry route and dump node forms.

Routes
  R1  torch.export.export(m, args)                 (default IR = training IR in 2.13)
  R2  R1.run_decompositions()                      (core ATen)
  R3s torch.compile(m, backend=aot_autograd(fw_compiler=capture))  static
  R3d same, dynamic=True
  R4  make_fx(f, tracing_mode="symbolic")
  R4p make_fx(f, tracing_mode="symbolic", pre_dispatch=True)

Each dump line:  name = op target(args, kwargs) :: val   {meta keys}
"""
from __future__ import annotations

import contextlib
import io
import sys
import traceback

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.proxy_tensor import make_fx

OUT = None  # file handle set by begin()


def p(*a):
    print(*a, file=OUT or sys.stdout)


def val_str(v):
    if isinstance(v, torch.Tensor):
        kind = type(v).__name__
        s = f"{kind}({list(v.shape)},{str(v.dtype).replace('torch.', '')}"
        if v.requires_grad:
            s += ",rg"
        return s + ")"
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{type(v).__name__}({v.node.expr})"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(val_str(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    return repr(v)


def arg_str(a):
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(arg_str(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}={arg_str(v)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.dtype):
        return str(a)
    return repr(a)


def tgt_str(n):
    t = n.target
    if n.op == "call_function":
        if isinstance(t, torch._ops.OpOverload):
            return f"{t.namespace}.{t._opname}.{t._overloadname}"
        if isinstance(t, torch._ops.HigherOrderOperator):
            return f"higher_order.{t.__name__}"
        mod = getattr(t, "__module__", "")
        return f"{mod}.{getattr(t, '__name__', t)}"
    return str(t)


SKIP_KEYS = {"stack_trace", "source_fn_stack", "nn_module_stack", "original_aten", "from_node",
             "seq_nr", "torch_fn", "tensor_meta", "val", "custom", "partitioner_tag"}


def dump_gm(gm: torch.fx.GraphModule, indent="", keys=True):
    for n in gm.graph.nodes:
        v = n.meta.get("val", "<no val>")
        extra = ""
        if "unbacked_bindings" in n.meta:
            extra += f" unbacked_bindings={ {str(k): v for k, v in n.meta['unbacked_bindings'].items()} }"
        mk = sorted(k for k in n.meta if k not in SKIP_KEYS)
        if n.op == "placeholder":
            line = f"{n.name}: placeholder"
        elif n.op == "output":
            line = f"output({arg_str(n.args)})"
        elif n.op == "get_attr":
            line = f"{n.name} = get_attr {n.target}"
        else:
            a = arg_str(tuple(n.args))
            kw = f", kwargs={arg_str(n.kwargs)}" if n.kwargs else ""
            line = f"{n.name} = {tgt_str(n)}{a}{kw}"
        allk = sorted(n.meta)
        p(f"{indent}{line}  :: {val_str(v) if v != '<no val>' else v}{extra}" + (f"   meta={allk}" if keys else ""))
    for name, sub in gm.named_children():
        if isinstance(sub, torch.fx.GraphModule):
            p(f"{indent}-- submodule {name}:")
            dump_gm(sub, indent + "    ", keys=False)


def dump_sig(ep):
    sig = ep.graph_signature
    for s in sig.input_specs:
        p(f"  in : {s.kind.name:18s} {s.arg.name:24s} target={s.target} persistent={s.persistent}")
    for s in sig.output_specs:
        p(f"  out: {s.kind.name:18s} {s.arg.name:24s} target={s.target}")
    if ep.constants:
        p(f"  ep.constants: { {k: val_str(v) for k, v in ep.constants.items()} }")
    rc = getattr(ep, "range_constraints", {})
    if rc:
        p(f"  range_constraints: { {str(k): str(v) for k, v in rc.items()} }")


def _hdr(s):
    p(f"\n### {s}")


@contextlib.contextmanager
def guarded(label):
    try:
        yield
    except Exception as e:  # record, keep going
        msg = str(e).strip().splitlines()
        p(f"  !! {label} raised {type(e).__name__}: {' | '.join(msg[:6])}")


def r1(m, args, dynamic_shapes=None, strict=False):
    _hdr("R1 torch.export.export" + (" dyn" if dynamic_shapes else "") + (" strict" if strict else ""))
    ep = None
    with guarded("R1"):
        ep = torch.export.export(m, args, dynamic_shapes=dynamic_shapes, strict=strict)
        dump_gm(ep.graph_module)
        dump_sig(ep)
    return ep


def r2(ep):
    _hdr("R2 ep.run_decompositions()")
    if ep is None:
        p("  (no ep)")
        return None
    with guarded("R2"):
        ep2 = ep.run_decompositions()
        dump_gm(ep2.graph_module)
        dump_sig(ep2)
        return ep2


def r3(m, args, dynamic=False, mark=None, label="", no_grad=False, fullgraph=False):
    _hdr(f"R3 torch.compile aot_autograd {'dynamic=True' if dynamic else 'static'} {label}")
    torch._dynamo.reset()
    graphs = []

    def fw(gm, example_inputs):
        graphs.append(("fw", gm, example_inputs))
        return gm.forward

    def bw(gm, example_inputs):
        graphs.append(("bw", gm, example_inputs))
        return gm.forward

    be = aot_autograd(fw_compiler=fw, bw_compiler=bw)
    with guarded("R3"):
        c = torch.compile(m, backend=be, dynamic=dynamic, fullgraph=fullgraph)
        ctx = torch.no_grad() if no_grad else contextlib.nullcontext()
        with ctx:
            c(*args)
        for kind, gm, ex in graphs:
            if kind != "fw":
                continue
            p(f"-- fw graph; example_inputs: {val_str(list(ex))}")
            dump_gm(gm)
    p(f"  (#fw graphs={sum(1 for g in graphs if g[0]=='fw')})")
    return graphs


def r4(f, args, pre_dispatch=False):
    _hdr(f"R4 make_fx symbolic{' pre_dispatch' if pre_dispatch else ''}")
    with guarded("R4"):
        gm = make_fx(f, tracing_mode="symbolic", pre_dispatch=pre_dispatch)(*args)
        dump_gm(gm)
        return gm


def all_routes(title, m, args, dynamic_shapes=None, make_fx_fn=None, skip=()):
    p(f"\n{'=' * 70}\n## {title}\n{'=' * 70}")
    if isinstance(m, torch.nn.Module):
        m.eval() if getattr(m, "_eval", False) else None
    ep = None
    if "R1" not in skip:
        ep = r1(m, args)
    if "R2" not in skip:
        r2(ep)
    if dynamic_shapes is not None:
        epd = r1(m, args, dynamic_shapes=dynamic_shapes)
        if "R2" not in skip:
            r2(epd)
    if "R3s" not in skip:
        r3(m, [a.clone() if isinstance(a, torch.Tensor) else a for a in args], dynamic=False)
    if "R3d" not in skip:
        r3(m, [a.clone() if isinstance(a, torch.Tensor) else a for a in args], dynamic=True)
    for pd in (False, True):
        if ("R4p" if pd else "R4") in skip:
            continue
        f, a = r4_fn(m, args, make_fx_fn)
        r4(f, a, pre_dispatch=pd)


def r4_fn(m, args, make_fx_fn=None):
    """make_fx cannot see real params/buffers under symbolic tracing: pass module state
    as leading inputs through torch.func.functional_call (placeholders come first)."""
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    if make_fx_fn is not None:
        return make_fx_fn, args
    if isinstance(m, torch.nn.Module):
        state = {**dict(m.named_parameters()), **dict(m.named_buffers())}
        if state:
            names = list(state)
            vals = [v.detach().clone() for v in state.values()]
            n = len(names)

            def f(*a):
                return torch.func.functional_call(m, dict(zip(names, a[:n])), tuple(a[n:]))
            return f, vals + args
    return (lambda *a: m(*a)), args


def begin(path):
    global OUT
    OUT = open(path, "w")
    p(f"# torch {torch.__version__}")


def end():
    OUT.close()
