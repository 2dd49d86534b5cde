"""Family 1: pooling defaults (stride omitted)."""
import torch, torch.nn.functional as F
from harness import *

begin("out/fam1.txt")

class M(torch.nn.Module):
    def __init__(self, fn): super().__init__(); self.fn = fn
    def forward(self, x): return self.fn(x)

cases = {
 "max_pool1d(x,2)": (lambda x: F.max_pool1d(x, 2), (1, 3, 8)),
 "max_pool2d(x,2)": (lambda x: F.max_pool2d(x, 2), (1, 3, 8, 8)),
 "max_pool3d(x,2)": (lambda x: F.max_pool3d(x, 2), (1, 3, 8, 8, 8)),
 "avg_pool1d(x,2)": (lambda x: F.avg_pool1d(x, 2), (1, 3, 8)),
 "avg_pool2d(x,2)": (lambda x: F.avg_pool2d(x, 2), (1, 3, 8, 8)),
 "avg_pool3d(x,2)": (lambda x: F.avg_pool3d(x, 2), (1, 3, 8, 8, 8)),
 "max_pool2d(x,2,return_indices=True)": (lambda x: F.max_pool2d(x, 2, return_indices=True), (1, 3, 8, 8)),
 "max_pool1d(x,2,return_indices=True)": (lambda x: F.max_pool1d(x, 2, return_indices=True), (1, 3, 8)),
 "max_pool3d(x,2,return_indices=True)": (lambda x: F.max_pool3d(x, 2, return_indices=True), (1, 3, 8, 8, 8)),
 "max_pool2d(x,3,ceil_mode=True)": (lambda x: F.max_pool2d(x, 3, ceil_mode=True), (1, 3, 8, 8)),
 "avg_pool2d(x,3,ceil_mode=True)": (lambda x: F.avg_pool2d(x, 3, ceil_mode=True), (1, 3, 8, 8)),
 "max_pool2d(x,(2,3),padding=1)": (lambda x: F.max_pool2d(x, (2, 3), padding=1), (1, 3, 8, 8)),
 "avg_pool3d(x,2,count_include_pad=False,divisor_override=3)": (lambda x: F.avg_pool3d(x, 2, count_include_pad=False, divisor_override=3), (1, 3, 8, 8, 8)),
 "nn.MaxPool2d(2)": (torch.nn.MaxPool2d(2), (1, 3, 8, 8)),
 "nn.AvgPool2d(2)": (torch.nn.AvgPool2d(2), (1, 3, 8, 8)),
 "adaptive_avg_pool2d(x,1)": (lambda x: F.adaptive_avg_pool2d(x, 1), (1, 3, 8, 8)),
}
for title, (fn, shape) in cases.items():
    m = fn if isinstance(fn, torch.nn.Module) else M(fn)
    all_routes(title, m, (torch.randn(*shape),))
end()
