"""Check recorded ttnn calls against the real `ttnn` package (run with ttnn's Python, 3.10; torch not needed).

    python tools/ttnn_check/check_calls.py calls.json

`calls.json` is what `tests/backends/ttnn/recording.py` records while the
backend runs models on the test double: every distinct ttnn call
`backends/ttnn/dispatch.py` and `runtime.py` make (function path, arguments
described by kind: ttnn tensor, layout, dtype, memory config, device, numbers,
lists), the module attributes they read, the double's own signature of each
function and the attributes its Tensor offers. For each call this script

- finds the function at that path in ttnn (a moved or renamed function fails);
- binds the arguments to ttnn's nanobind overloads the way nanobind resolves
  them: positional count, keyword names, keyword-only parameters, required
  parameters, and each value's kind against the parameter's type (a wrong
  keyword, a missing argument or a tensor where a number goes fails);
- replays, on real host tensors, the calls ttnn runs without a device
  (`reshape`, `pad` and `to_layout` of row-major tensors) and compares the
  result's shape with the double's; `open_device` is called for real (without
  a card it raises RuntimeError after binding, TypeError when binding fails);

and checks that the double's parameters exist in ttnn with the same kind and
that ttnn.Tensor has what dispatch reads from the double's Tensor. Exit status
1 lists every mismatch; 0 prints a summary.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Iterator
from typing import Any

import ttnn

#: calls ttnn runs on host tensors without a device (others segfault or need a card, so they are only bound)
HOST_REPLAY = ("ttnn.reshape", "ttnn.pad", "ttnn.to_layout")
#: called for real: without a card they raise RuntimeError once the arguments are bound
CALLED_FOR_REAL = ("ttnn.open_device",)


class Param:
    def __init__(self, name: str, annotation: str, has_default: bool, kind: str) -> None:
        self.name, self.annotation, self.has_default, self.kind = name, annotation, has_default, kind

    def __repr__(self) -> str:
        return f"{self.name}: {self.annotation}{' = ...' if self.has_default else ''} ({self.kind})"


def _split_top(text: str, sep: str) -> list[str]:
    """Split at `sep` outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i):
            parts.append(text[start:i])
            start = i + len(sep)
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_nb_signature(sig: str) -> list[Param]:
    """The parameters of a nanobind signature string `def f(self, a: T, *, b: U = \\0) -> R`."""
    body = sig[sig.index("(") + 1 :]
    depth, end = 1, 0
    while end < len(body) and depth:
        depth += (body[end] == "(") - (body[end] == ")")
        end += 1
    end -= 1
    params, kind = [], "positional_or_keyword"
    for part in _split_top(body[:end], ","):
        part = part.replace("\\*", "*")
        if part == "self":
            continue
        if part == "*":
            kind = "keyword_only"
            continue
        if part == "/":
            for p in params:
                p.kind = "positional_only"
            continue
        name, _, rest = part.partition(":")
        annotation, _, default = rest.partition("=")
        params.append(Param(name.strip(), annotation.strip(), bool(default.strip()), kind))
    return params


def _python_params(fn: Any) -> list[Param]:
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional_only",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional_or_keyword",
        inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    }
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in kinds:
            annotation = "" if p.annotation is inspect.Parameter.empty else str(p.annotation)
            out.append(Param(p.name, annotation, p.default is not inspect.Parameter.empty, kinds[p.kind]))
    return out


def resolve(path: str) -> Any:
    obj: Any = ttnn
    for part in path.split(".")[1:]:
        if not hasattr(obj, part):
            raise LookupError(
                f"{path}: ttnn {ttnn.__version__ if hasattr(ttnn, '__version__') else ''} has no {part!r}"
            )
        obj = getattr(obj, part)
    return obj


def overloads(obj: Any) -> list[list[Param]]:
    """Every signature ttnn offers for `obj` (an operation, a nanobind function or a Python function)."""
    fn = getattr(obj, "function", obj)  # ttnn's FastOperation wraps the bound operation
    nb = getattr(fn, "__nb_signature__", None) or getattr(type(fn).__call__, "__nb_signature__", None)
    if nb:
        return [parse_nb_signature(s[0]) for s in nb]
    return [_python_params(fn)]


# -- what a described value may bind to ------------------------------------------------------------

_TENSOR = ("ttnn._ttnn.tensor.Tensor", "ttnn.Tensor")


def _alternatives(annotation: str) -> list[str]:
    a = annotation.replace("typing.", "").strip()
    if a.startswith("<class '") and a.endswith("'>"):
        a = a[8:-2]
    if a.startswith("Optional[") and a.endswith("]"):
        return [*_alternatives(a[9:-1]), "None"]
    if a.startswith("Union[") and a.endswith("]"):
        return [x for part in _split_top(a[6:-1], ",") for x in _alternatives(part)]
    return [p.strip().strip("'\"") for p in _split_top(a, "|")] if "|" in a else [a.strip("'\"")]


def _elem(alt: str) -> str | None:
    for prefix in ("collections.abc.Sequence[", "Sequence[", "list[", "List[", "tuple[", "Tuple["):
        if alt.startswith(prefix) and alt.endswith("]"):
            return alt[len(prefix) : -1].split(",")[0].strip()
    return None


def accepts(annotation: str, value: dict) -> bool:
    """Whether a value of this kind binds to a parameter of this (nanobind or Python) type."""
    if not annotation:
        return True
    return any(_accepts_one(alt, value) for alt in _alternatives(annotation))


def _accepts_one(alt: str, value: dict) -> bool:
    kind = value["kind"]
    if kind == "none":
        return alt in ("None", "NoneType")
    if kind == "tensor":
        return alt in _TENSOR
    if kind == "torch_tensor":
        return "torch.Tensor" in alt
    if kind == "torch_dtype":
        return "torch.dtype" in alt
    if kind in ("layout", "dtype", "memory_config", "device"):
        wanted = {"layout": "Layout", "dtype": "DataType", "memory_config": "MemoryConfig", "device": "MeshDevice"}
        return alt.endswith(wanted[kind]) or (kind == "device" and alt.endswith("Device"))
    if kind == "bool":
        return alt == "bool"
    if kind == "int":
        return alt in ("int", "float")  # nanobind converts an int to a float parameter
    if kind == "float":
        return alt == "float"
    if kind == "str":
        return alt == "str"
    if kind in ("list", "tuple"):
        elem = _elem(alt)
        if alt.endswith("types.Shape"):
            elem = "int"
        if elem is None:
            return False
        return all(_accepts_one(elem, item) or accepts(elem, item) for item in value["items"])
    return False


def bind(params: list[Param], args: list[dict], kwargs: dict[str, dict]) -> str | None:
    """None if the call binds to this overload, else why not."""
    positional = [p for p in params if p.kind != "keyword_only"]
    if len(args) > len(positional):
        return f"{len(args)} positional arguments, this overload takes at most {len(positional)}"
    bound: dict[str, dict] = {}
    for p, a in zip(positional, args):
        bound[p.name] = a
    by_name = {p.name: p for p in params}
    for name, value in kwargs.items():
        p = by_name.get(name)
        if p is None:
            return f"no parameter named {name!r}"
        if p.kind == "positional_only":
            return f"{name!r} is positional-only"
        if name in bound:
            return f"{name!r} given twice"
        bound[name] = value
    missing = [p.name for p in params if not p.has_default and p.name not in bound]
    if missing:
        return f"missing {missing}"
    for name, value in bound.items():
        if not accepts(by_name[name].annotation, value):
            return f"{name}: a {_show(value)} does not bind to {by_name[name].annotation}"
    return None


def _show(value: dict) -> str:
    kind = value["kind"]
    if kind in ("list", "tuple"):
        return f"{kind} of [{', '.join(_show(v) for v in value['items'][:3])}]"
    return kind


# -- real calls ------------------------------------------------------------------------------------


def _real(value: dict) -> Any:
    """A real ttnn value for a described one (host tensors: row-major bfloat16 zeros of the shape)."""
    kind = value["kind"]
    if kind == "tensor":
        shape = value["shape"]
        count = 1
        for s in shape:
            count *= s
        dtype = ttnn.uint32 if value["dtype"] in ("uint32", "int32") else ttnn.bfloat16
        data = [0] * count if dtype == ttnn.uint32 else [0.0] * count
        return ttnn.Tensor(data, shape, dtype, ttnn.ROW_MAJOR_LAYOUT)
    if kind == "layout":
        return getattr(ttnn, f"{value['name']}_LAYOUT")
    if kind == "dtype":
        return getattr(ttnn, value["name"])
    if kind == "memory_config":
        return getattr(ttnn, f"{value['name']}_MEMORY_CONFIG")
    if kind in ("list", "tuple"):
        items = [_real(v) for v in value["items"]]
        return items if kind == "list" else tuple(items)
    if kind == "none":
        return None
    return value["value"]


def replay(call: dict) -> str | None:
    """Run a host-runnable call on real host tensors; None if it ran and gave the double's shape."""
    path = call["path"]
    if path == "ttnn.open_device":
        try:
            resolve(path)(*[_real(a) for a in call["args"]], **{k: _real(v) for k, v in call["kwargs"].items()})
        except TypeError as e:
            return f"ttnn refuses the arguments: {' '.join(str(e).split())[:300]}"
        except RuntimeError:
            return None  # bound, then found no Tenstorrent card
        return None
    if path not in HOST_REPLAY or not call["args"] or call["args"][0]["kind"] != "tensor":
        return None
    first = call["args"][0]
    if path == "ttnn.to_layout" and call["args"][1:2] != [{"kind": "layout", "name": "ROW_MAJOR"}]:
        return None  # tilizing needs a device (the tile size comes from the cluster)
    size = 1
    for s in first["shape"]:
        size *= s
    if size > 1 << 20:
        return None
    args = [_real(a) for a in call["args"]]
    kwargs = {k: _real(v) for k, v in call["kwargs"].items()}
    try:
        out = resolve(path)(*args, **kwargs)
    except TypeError as e:
        return f"ttnn refuses the arguments: {' '.join(str(e).split())[:300]}"
    except RuntimeError as e:
        return f"ttnn fails on host tensors: {' '.join(str(e).split())[:200]}"
    got, want = list(out.shape), call["result"].get("shape") if call.get("result") else None
    if want is not None and got != want:
        return f"ttnn's result has shape {got}, the double's {want}"
    return None


# -- the double against ttnn -------------------------------------------------------------------------


def check_double_signature(path: str, double: list[dict], real: list[list[Param]]) -> str | None:
    """Every parameter of the double exists in one ttnn overload, with the same kind and position."""
    reasons = []
    for params in real:
        names = [p.name for p in params]
        problems = []
        for i, d in enumerate(double):
            if d["name"] not in names:
                problems.append(f"ttnn has no parameter {d['name']!r}")
                continue
            p = params[names.index(d["name"])]
            if d["kind"] == "keyword_only" and p.kind == "positional_only":
                problems.append(f"{d['name']!r} is positional in ttnn")
            if d["kind"] != "keyword_only" and (p.kind == "keyword_only" or names.index(d["name"]) != i):
                problems.append(f"{d['name']!r} is {p.kind} at position {names.index(d['name'])} in ttnn")
        if not problems:
            return None
        reasons.append("; ".join(problems))
    return f"the double's {path} matches no ttnn overload: " + " | ".join(reasons)


def check(record: dict) -> Iterator[str]:
    for attr in record.get("attributes", []):
        try:
            resolve(attr)
        except LookupError as e:
            yield f"attribute {e}"
    for name in record.get("tensor_attributes", []):
        if not hasattr(ttnn.Tensor, name):
            yield f"ttnn.Tensor has no {name!r}, which dispatch reads from the double's Tensor"
    seen_double: set[str] = set()
    for call in record["calls"]:
        where = f"{call['path']} (from {call.get('site', '?')})"
        try:
            obj = resolve(call["path"])
        except LookupError as e:
            yield f"{where}: {e}"
            continue
        real = overloads(obj)
        why = [bind(params, call["args"], call["kwargs"]) for params in real]
        if call["path"] in CALLED_FOR_REAL:
            why = [None]  # its nanobind signature shows no defaults; the real call below binds it
        if all(why):
            shown = ", ".join([_show(a) for a in call["args"]] + [f"{k}={_show(v)}" for k, v in call["kwargs"].items()])
            yield f"{where}({shown}): binds to no ttnn overload: " + " | ".join(w for w in why if w)
            continue
        problem = replay(call)
        if problem:
            yield f"{where}: {problem}"
        if call["path"] not in seen_double and call.get("double_signature") is not None:
            seen_double.add(call["path"])
            problem = check_double_signature(call["path"], call["double_signature"], real)
            if problem:
                yield problem


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        record = json.load(f)
    problems = list(dict.fromkeys(check(record)))
    paths = sorted({c["path"] for c in record["calls"]})
    if problems:
        print(f"{len(problems)} of the backend's ttnn calls do not match ttnn {_version()}:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print(
        f"ttnn {_version()}: {len(record['calls'])} distinct calls to {len(paths)} functions bind to the real "
        f"signatures; {sum(c['path'] in HOST_REPLAY for c in record['calls'])} replayed where ttnn runs on the host"
    )
    return 0


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ttnn")
    except Exception:
        return "(version unknown)"


if __name__ == "__main__":
    sys.exit(main(sys.argv))
