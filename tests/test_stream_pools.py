"""``xpu.stream_pools``: an allocator snapshot summed by stream, as a log line."""
from __future__ import annotations

from xpu.stream_pools import StreamPool, by_stream, describe

MB = 1 << 20


def _segment(device: int, stream: int, total: int, blocks: list[tuple[int, str]]) -> dict:
    return {"device": device, "stream": stream, "total_size": total,
            "allocated_size": sum(size for size, state in blocks if state == "active_allocated"),
            "blocks": [{"size": size, "state": state} for size, state in blocks]}


def test_segments_are_summed_by_stream_and_device_largest_first():
    snapshot = [
        _segment(0, 0, 100 * MB, [(60 * MB, "active_allocated"), (40 * MB, "inactive")]),
        _segment(0, 0xA0, 300 * MB, [(100 * MB, "active_pending_free"), (200 * MB, "inactive")]),
        _segment(0, 0xB0, 20 * MB, [(20 * MB, "inactive")]),
        _segment(0, 0, 50 * MB, [(50 * MB, "active_allocated")]),
        _segment(1, 0xA0, 999 * MB, [(999 * MB, "active_allocated")]),  # another device's
    ]
    pools = by_stream(snapshot, 0, {0xA0: "d2h"})
    assert list(pools) == ["d2h", "default", "stream 0xb0"]
    assert pools["d2h"] == StreamPool(300 * MB, 0, 100 * MB)
    assert pools["default"] == StreamPool(150 * MB, 110 * MB, 0)
    assert pools["stream 0xb0"] == StreamPool(20 * MB, 0, 0)


def test_a_named_default_stream_takes_its_callers_name():
    pools = by_stream([_segment(0, 0, 10 * MB, [])], 0, {0: "compute"})
    assert list(pools) == ["compute"]


def test_the_line_says_allocated_and_pending_only_where_not_zero():
    line = describe({"compute": StreamPool(15_900_000_000, 200_000_000, 0),
                     "d2h": StreamPool(800_000_000, 0, 300_000_000), "h2d": StreamPool(20_000_000, 0, 0)})
    assert line == "compute 15.9 GB (200.0 MB allocated), d2h 800.0 MB (300.0 MB pending free), h2d 20.0 MB"
    assert describe({}) == ""
