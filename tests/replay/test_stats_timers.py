"""ReplayStats phase timers: wall clock on CPU; on CUDA event pairs resolved only when a time is read
(the CUDA branch is exercised by benchmarks/gpu_check.py; here its bookkeeping, with event stand-ins)."""

from __future__ import annotations

import pytest
import torch

from augtree_verl.replay.stats import ReplayStats


class _Event:
    """What ``stop_timer`` keeps of a CUDA event: ``synchronize`` and ``elapsed_time`` (milliseconds)."""

    def __init__(self, ms: float, log: list):
        self.ms, self.log = ms, log

    def synchronize(self):
        self.log.append("sync")

    def elapsed_time(self, end):
        return end.ms - self.ms


def test_cpu_timer_adds_wall_clock():
    stats = ReplayStats(replay_s=1.0)
    start = stats.start_timer(torch.device("cpu"))
    assert isinstance(start, float)
    stats.stop_timer("replay_s", start)
    assert stats.replay_s > 1.0 and stats.prefill_s == 0.0
    with pytest.raises(ValueError, match="unknown phase 'decode_s'"):
        stats.stop_timer("decode_s", start)


def test_event_pairs_are_resolved_only_when_read(monkeypatch):
    log = []
    ends = iter([_Event(250.0, log), _Event(1500.0, log)])
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: next(ends))
    monkeypatch.setattr(_Event, "record", lambda self: None, raising=False)
    stats = ReplayStats()
    stats.stop_timer("prefill_s", _Event(0.0, log))
    stats.stop_timer("prefill_s", _Event(1000.0, log))
    assert log == []  # nothing waited for yet: the hot loop never syncs on timing
    assert stats.prefill_s == pytest.approx(0.75)  # reading a phase time resolves the pending pairs
    assert log == ["sync", "sync"]
