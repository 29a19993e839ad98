"""Progress counters: bytes, speed and ETA on a controlled clock; cancellation through the library's bars."""

from __future__ import annotations

import threading

import pytest

from exo.downloads import DownloadCancelledError, ProgressTracker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bytes_speed_and_eta():
    clock = Clock()
    tracker = ProgressTracker(clock=clock)
    tracker.set_status("downloading")
    tracker.add_work(files=2, total_bytes=3000)
    bar_a, bar_b = tracker.bar_class("a")(total=1000), tracker.bar_class("b")(total=2000)
    for _ in range(4):  # 500 bytes per second for 4 s
        clock.now += 1
        bar_a.update(250)
        bar_b.update(250)
    snap = tracker.snapshot()
    assert (snap.bytes_done, snap.bytes_total, snap.files_done) == (2000, 3000, 0)
    assert snap.current_files == ("a", "b")
    assert snap.speed_bytes_per_s == pytest.approx(500)
    assert snap.eta_s == pytest.approx(2.0)
    tracker.file_done("a", 1000)
    bar_b.update(-250)  # the library rewinds a file whose server ignored a Range request
    assert tracker.snapshot().bytes_done == 1750
    clock.now += 20  # stalled: the speed decays instead of staying at its last value
    assert tracker.snapshot().speed_bytes_per_s < 100
    tracker.file_done("b", 2000)
    tracker.set_status("complete")
    final = tracker.snapshot()
    assert (final.bytes_done, final.files_done, final.eta_s, final.fraction) == (3000, 2, 0.0, 1.0)
    assert final.to_json()["status"] == "complete" and final.to_json()["current_files"] == []


def test_cancel_and_stop_raise_inside_the_library_bar():
    tracker = ProgressTracker()
    stop = threading.Event()
    bar = tracker.bar_class("shard", stop)(total=10)
    bar.update(5)
    bar.update_transfer(5)  # network bytes of the same chunk: not counted twice
    assert tracker.snapshot().bytes_done == 5
    stop.set()
    with pytest.raises(DownloadCancelledError, match="another file of this download failed"):
        bar.update(1)
    tracker.cancel()
    with pytest.raises(DownloadCancelledError, match="cancelled"):
        tracker.bar_class("next")(total=10)  # a file that has not started does not start
    assert tracker.cancelled and tracker.cancel_event.is_set()


def test_listeners_see_every_change():
    seen = []
    tracker = ProgressTracker(listener=seen.append)
    tracker.set_status("downloading")
    tracker.add_work(1, 10)
    tracker.bar_class("x")(total=10).update(10)
    tracker.file_done("x", 10)
    assert [s.bytes_done for s in seen] == [0, 0, 10, 10] and seen[-1].files_done == 1
