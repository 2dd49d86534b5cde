"""torchvision's model code on CPU torch: the few compiled ops it needs, as Python custom ops.

PyPI's torchvision wheel for Linux is a CUDA build: its `_C.so` links
`libc10_cuda.so` and does not load next to the CPU torch this project pins.
torchvision itself copes with that (`torchvision.extension._has_ops()` is
False and `roi_align` takes its pure-Python path), except that its fake
registrations for `torchvision::nms` and `torchvision::qnms` need the ops to
exist, so `import torchvision` raises `operator torchvision::nms does not
exist`, and so does `import transformers` (it imports torchvision when it is
installed) and timm.

`install()` defines those two ops (their schemas as torchvision declares
them) with Python implementations before torchvision is imported, and
tells torchvision's op check that they are there. The model definitions
(`torchvision.models`, timm) are pure Python and need nothing else; an op
still missing (`deform_conv2d`, `ps_roi_align`, ...) raises torchvision's own
error. Call it before the first import of torchvision, transformers or timm.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

#: what torchvision's C++ library declares for the ops its import registers fake kernels for
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

_library: torch.library.Library | None = None


def _box_area(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


@torch.compiler.disable  # a kernel, as torchvision's C++ one is: dynamo must not trace its data-dependent loop
def nms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression: indices of the kept boxes, by decreasing score (torchvision's contract)."""
    if dets.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=dets.device)
    order = torch.argsort(scores, descending=True, stable=True)
    boxes = dets[order].double()
    top_left = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
    bottom_right = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    wh = (bottom_right - top_left).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    area = _box_area(boxes)
    iou = inter / (area[:, None] + area[None, :] - inter)
    suppressed = torch.zeros(len(order), dtype=torch.bool)
    overlaps = (iou > iou_threshold).tolist()
    kept: list[int] = []
    for i in range(len(order)):
        if suppressed[i]:
            continue
        kept.append(i)
        suppressed |= torch.tensor(overlaps[i])
    return order[torch.tensor(kept, dtype=torch.long)]


def _qnms(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    return nms(dets.float(), scores.float(), iou_threshold)


def _compiled_library_loads() -> bool:
    """Whether torchvision's own `_C` library loads here (a CPU build does; PyPI's Linux wheel does not)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = Path(next(iter(spec.submodule_search_locations)))
    for path in folder.glob("_C.*"):
        try:
            torch.ops.load_library(str(path))
            return True
        except (OSError, RuntimeError):
            return False
    return False


def install() -> None:
    """Make `import torchvision` work on CPU torch when its compiled library cannot load (idempotent)."""
    global _library
    if _library is not None or importlib.util.find_spec("torchvision") is None:
        return
    if "torchvision" in sys.modules:
        if hasattr(torch.ops.torchvision, "nms"):
            return  # imported with its own library, or after an earlier install()
        raise RuntimeError(
            "torchvision_cpu.install() must run before torchvision is imported (transformers and timm import it)"
        )
    if _compiled_library_loads():
        return
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS.values():
        library.define(schema)
    library.impl("nms", nms, "CPU")
    library.impl("qnms", _qnms, "CPU")
    _library = library
    import torchvision.extension

    # nms checks torchvision's flag before calling the op; roi_align reads its own copy of the flag (still
    # False) and takes its pure-Python path, which torch.export and dynamo trace
    torchvision.extension._has_ops = lambda: True
