"""benchmarks/prefill_profile.py: the prefill call it profiles."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from prefill_profile import STEP, command


def test_a_prefill_of_n_tokens_from_position_0():
    cmd = command(Path("lm.vmfb"), Path("lm.irpa"), 544, 8)
    assert "--function=prefill" in cmd and "--parameters=model=lm.irpa" in cmd
    assert cmd[-4:] == ["--input=1x8xi64=5", "--input=1x544xi64=1", "--input=1x8xi64=0", "--input=1xi64=0"]
    assert STEP.sub("", "prefill$async_dispatch_73_elementwise_i8xf32_pack") == "dispatch_73_elementwise_i8xf32_pack"
