"""A hand-written masked attention dispatch (issue 34): FlashAttention-2's loop, one row block a workgroup.

The attention softmax(scale q K^T, masked) V of a row block a workgroup, FlashAttention-2's loop over blocks of
`KEYS` keys in registers (the kernel's text and its blocks per ISA: flash_attention_kernel.py); here the op, the
keys' and values' layouts it reads (`pack_keys`, `pad_values`) and the splice.

It enters a graph as `fx_rewrites::flash_attention(q, k_packed, v_padded, mask, scale, keys, lanes)` (eager: the
keys unpacked, torch's SDPA), imported by torch-mlir as `torch.operator "torch.fx_rewrites.flash_attention"`;
`splice` (run by `IreeBackend` through `kernels.spliced`) replaces each call by a `flow.dispatch` of its
`stream.executable` (the kernel's text: flash_attention_kernel.py). The rule writing it is
`rules/flash_attention.py`'s.
"""

from __future__ import annotations

import re

import torch

from fx_rewrites.backends.iree import spliced
from fx_rewrites.backends.iree.flash_attention_kernel import (  # noqa: F401  (re-exported: the rule's and tests')
    BLOCKS,
    KEYS,
    LANES,
    ROWS,
    Block,
    Shape,
    block_of,
    executable,
)

OP, MARK = "fx_rewrites::flash_attention", "torch.fx_rewrites.flash_attention"
MARKS = (MARK,)


def pack_keys(k: torch.Tensor) -> torch.Tensor:
    """k [b, kv, keys, D] as [b, kv, padded / KEYS, D, KEYS] (the keys padded with zeros to a multiple of KEYS)."""
    b, kv, keys, size = k.shape
    padded = -(-keys // KEYS) * KEYS
    k = torch.nn.functional.pad(k, (0, 0, 0, padded - keys))
    return k.view(b, kv, padded // KEYS, KEYS, size).transpose(-1, -2).contiguous()


def pad_values(v: torch.Tensor) -> torch.Tensor:
    keys = v.shape[-2]
    return torch.nn.functional.pad(v, (0, 0, 0, -(-keys // KEYS) * KEYS - keys))


@torch.library.custom_op(OP, mutates_args=())
def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, keys: int, lanes: int
) -> torch.Tensor:
    """Attention of `q` [b, h, rows, D] over the first `keys` keys of `k` (`pack_keys`) and values `v`
    (`pad_values`) of kv heads (h a multiple of kv), `mask` [b, 1 or h, rows, keys] int8 (nonzero: the key is seen;
    None: every key); 0 where a row sees none. `lanes` names the ISA's block (`BLOCKS`; the same numbers in eager)."""
    b, kv, blocks, size, _ = k.shape
    keys_ = k.transpose(-1, -2).reshape(b, kv, blocks * KEYS, size)[:, :, :keys]
    if mask is None:
        return torch.nn.functional.scaled_dot_product_attention(q, keys_, v[:, :, :keys], scale=scale, enable_gqa=True)
    seen = mask != 0
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys_, v[:, :, :keys], attn_mask=seen, scale=scale, enable_gqa=True
    )
    return torch.where(seen.any(-1, keepdim=True), out, 0.0)


@flash_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, keys: int, lanes: int
) -> torch.Tensor:
    return torch.empty_like(q)


FLASH_ATTENTION = torch.ops.fx_rewrites.flash_attention.default

_CALL = re.compile(
    rf'^(\s*)(%[\w]+) = torch\.operator "{re.escape(MARK)}"\((%[\w#]+), (%[\w#]+), (%[\w#]+), (%[\w#]+), '
    r"(%[\w.+\-]+), (%[\w.+\-]+), (%[\w.+\-]+)\) : \((.*)\) -> (.*)$"
)
_FLOAT = re.compile(r"^\s*(%[\w.+\-]+) = torch\.constant\.float (\S+)", re.M)
_NONE = re.compile(r"^\s*(%[\w.+\-]+) = torch\.constant\.none\b", re.M)


def splice(mlir: str) -> str:
    """`mlir` with every `fx_rewrites.flash_attention` call replaced by a `flow.dispatch` of its executable."""
    floats, nones = dict(_FLOAT.findall(mlir)), set(_NONE.findall(mlir))

    def convert(line: str, ints: dict[str, str]) -> spliced.Spliced:
        found = _CALL.match(line)
        if not found or found.group(7) not in floats or not {found.group(8), found.group(9)} <= ints.keys():
            raise ValueError(f"a flash_attention call of an unknown form: {line.strip()[:200]}")
        pad, res, q, k, v, m, scale, keys, lanes, types, otype = found.groups()
        operands = (q, k, v) if m in nones else (q, k, v, m)
        vts = re.findall(r"!torch\.vtensor<[^>]*>", types)[: len(operands)]
        typed = [spliced._tensor(t) for t in vts]
        (tq, sq), (tk, sk), (tv, sv) = typed[:3]
        sm = typed[3][1] if m not in nones else ["0", "0", sq[2], ints[keys]]
        if len(sk) != 5 or sk[4] != str(KEYS) or "?" in "".join(sq[:2] + sq[3:] + sk + sv + sm[:2] + sm[3:]):
            raise ValueError(f"a flash_attention call with a dynamic size other than the rows: {line.strip()[:200]}")
        mask_heads = int(sm[1]) if m not in nones else 0
        shape = Shape(int(sq[0]), int(sq[1]), int(sk[1]), int(ints[keys]), int(sq[3]), mask_heads,
                      float(floats[scale]), int(ints[lanes]))  # fmt: skip
        name, text = executable(shape)
        p = f"fa{res[1:]}"
        out = [f"{pad}%{p}_{i} = torch_c.to_builtin_tensor {x} : {vt} -> {tt}"
               for i, (x, vt, (tt, _)) in enumerate(zip(operands, vts, typed, strict=True))]  # fmt: skip
        out += [
            f"{pad}%{p}_two = arith.constant 2 : index",
            f"{pad}%{p}_rows = arith.constant {block_of(shape.lanes).rows} : index",
            f"{pad}%{p}_bh = arith.constant {shape.b * shape.heads} : index",
            f"{pad}%{p}_r = tensor.dim %{p}_0, %{p}_two : {tq}",
            f"{pad}%{p}_nb = arith.ceildivui %{p}_r, %{p}_rows : index",
            f"{pad}%{p}_n = arith.muli %{p}_nb, %{p}_bh : index",
        ]
        dq = "{%" + p + "_r}" if sq[2] == "?" else ""
        dm = "{%" + p + "_r}" if sm[2] == "?" else ""
        sig = ", ".join([f"{tq}{dq}", tk, tv, *([f"{typed[3][0]}{dm}"] if len(operands) == 4 else []), "index"])
        values = ", ".join(f"%{p}_{i}" for i in range(len(operands)))
        out += [
            f"{pad}%{p}_d = flow.dispatch @{name}::@{name}[%{p}_n]({values}, %{p}_r) : ({sig}) -> {tq}{dq}",
            f"{pad}{res} = torch_c.from_builtin_tensor %{p}_d : {tq} -> {otype.strip()}",
        ]
        return out, name, text

    return spliced.splice_each(mlir, MARK, "flash_attention", convert)
