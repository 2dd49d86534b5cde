"""benchmarks/decode_profile.py: iree-profile's statistics rows become ms per decode call, largest first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decode_profile
from decode_profile import per_call


def _function(name: str, count: int, ns: int) -> dict:
    return {
        "row_type": "host_execution_function",
        "function_name": name,
        "sample_count": count,
        "total_duration_ns": ns,
    }


def _queue(event: str, count: int, ns: int) -> dict:
    return {"row_type": "host_execution_queue_operation", "event_name": event, "sample_count": count,
            "total_duration_ns": ns}  # fmt: skip


def test_rows_become_ms_per_call_largest_first():
    rows = [
        {"type": "statistics_summary", "row_count": 6},
        _queue("alloca", 12, 400_000),
        _queue("dispatch", 8, 9_000_000),  # a queue's dispatch total: not a queue op of its own
        _function("decode$async_dispatch_2_reduction_1024_f32", 4, 8_000),
        _function("int4mv_1x1024x2816_t4_p8", 64, 16_000_000),
        _queue("execute", 1, 10_000_000),
        _queue("execute", 3, 30_000_000),  # two queues' rows: 4 calls in all
    ]
    got = per_call(rows)
    assert got["calls"] == 4 and got["execute"] == pytest.approx(10.0)
    assert got["functions"] == [
        ("int4mv_1x1024x2816_t4_p8", 16.0, pytest.approx(4.0)),
        ("dispatch_2_reduction_1024_f32", 1.0, pytest.approx(0.002)),
    ]
    assert got["queue"] == {"alloca": pytest.approx(0.1)}


def test_a_profile_without_calls_is_refused():
    with pytest.raises(ValueError, match="no command buffer executions"):
        per_call([_function("f", 1, 10)])


def test_an_ab_rotates_the_order_round_by_round(monkeypatch):
    calls = []

    def plain_ms(vmfb, irpa, cache, position, repetitions):
        calls.append(vmfb)
        assert irpa == vmfb.with_suffix(".irpa") and (cache, position, repetitions) == (48, 16, 10)
        return float(len(calls))

    monkeypatch.setattr(decode_profile, "plain_ms", plain_ms)
    a, b, c = (Path(f"{n}/lm.vmfb") for n in "abc")
    times = decode_profile.ab([a, b, c], 48, 16, 10, 3)
    assert times == {a: [1.0, 6.0, 8.0], b: [2.0, 4.0, 9.0], c: [3.0, 5.0, 7.0]}  # a b c, b c a, c a b
