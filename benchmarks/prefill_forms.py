"""Forms of one quantized linear over many rows (a prefill) on IREE (issue 33): which is at least float32's speed.

    python benchmarks/prefill_forms.py --rows 16
    python benchmarks/prefill_forms.py --rows 128 --forms f32,int8_blocked,int8_blocked_mm

benchmarks/int4_forms.py's harness (one weight [N, K], the module exported, imported as the backend does,
compiled with its flags, performance flags and aggressive fusion, timed by `iree-benchmark-module`, one thread,
median CPU time) over its forms and these, which read the same re-laid int8 parameters as the decode forms:

- `int8_blocked_mm`: int8 per channel from its [N/16, K, 16] blocks, converted to float32 and viewed [K, N] (a
  transpose of the blocks), a matmul, the per-channel scale after it: data tiling packs the converted weight.
- `int8_blocked_mm_bf16`: the same through bfloat16 (int8 -> bfloat16 is exact), for IREE's encoding to see
  a bfloat16 operand extended to float32.
- `int4_tiles4_mm`: int4 g32 from its [N/16, G/4, 32, 4, 16] blocks, dequantized ((q - z) * s, torchao's float32
  operations) and viewed [K, N], then a matmul (data tiled); `int4_tiles4_mm_symmetric`: without the zero points.
- `int4_blocked_mm_symmetric`: the same from int8's plain [N/16, K, 16] blocks (no groups interleaved), the
  scales [N/16, G, 16].
- `i8_int_mm`: W8A8 as torchao exports it: x quantized per row to int8 (symmetric), `_int_mm` with the int8
  weight [K, N], int32 -> float32 times both scales (IREE lowers `_int_mm` itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import int4_forms as forms


class Int8BlockedMm(forms.Int8Blocked):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.b.to(torch.float32).permute(1, 0, 2).reshape(self.k, self.n)
        return (x @ w) * self.s


class Int8BlockedMmBf16(forms.Int8Blocked):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.b.to(torch.bfloat16).to(torch.float32).permute(1, 0, 2).reshape(self.k, self.n)
        return (x @ w) * self.s


class Int4TilesMm(forms.Int4GroupTiles):
    symmetric = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nb, g, t = self.n // forms.BLOCK, self.g, self.tile
        values = self.b.to(torch.float32)  # [N/16, G/t, group, t, 16]
        if not self.symmetric:
            values = values - self.z.to(torch.float32).view(nb, g // t, 1, t, forms.BLOCK)
        deq = values * self.s.view(nb, g // t, 1, t, forms.BLOCK)
        w = deq.permute(1, 3, 2, 0, 4).reshape(self.k, self.n)  # [G/t, t, group, N/16, 16]: K then N
        return x @ w


class Int4TilesMmSymmetric(Int4TilesMm):
    symmetric = True


class Int4BlockedMm(forms.Int4UnpackedTwo):
    """int4 g32 symmetric from plain [N/16, K, 16] blocks (int8's layout), scales [N/16, G, 16]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nb, g, group = self.n // forms.BLOCK, self.g, self.group
        deq = self.b.to(torch.float32).view(nb, g, group, forms.BLOCK) * self.s.view(nb, g, 1, forms.BLOCK)
        return x @ deq.permute(1, 2, 0, 3).reshape(self.k, self.n)


class I8IntMm(torch.nn.Module):
    def __init__(self, q8: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("wt", q8.t().contiguous())
        self.register_buffer("s", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sx = x.abs().amax(1, keepdim=True).clamp(min=1e-7) / 127
        xq = torch.round(x / sx).clamp(-128, 127).to(torch.int8)
        return torch._int_mm(xq, self.wt).to(torch.float32) * sx * self.s


forms.FORMS.update(
    {
        "int8_blocked_mm": lambda w, q, q8, s8, s, z, g: Int8BlockedMm(q8, s8),
        "int8_blocked_mm_bf16": lambda w, q, q8, s8, s, z, g: Int8BlockedMmBf16(q8, s8),
        "int4_tiles4_mm": lambda w, q, q8, s8, s, z, g: Int4TilesMm(q, s, z, g, 4),
        "int4_tiles4_mm_symmetric": lambda w, q, q8, s8, s, z, g: Int4TilesMmSymmetric(q, s, z, g, 4),
        "int4_blocked_mm_symmetric": lambda w, q, q8, s8, s, z, g: Int4BlockedMm(q, s, z, g),
        "i8_int_mm": lambda w, q, q8, s8, s, z, g: I8IntMm(q8, s8),
    }
)

if __name__ == "__main__":
    raise SystemExit(forms.run())
