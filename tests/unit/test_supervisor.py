"""The launcher's Supervisor (services/launcher.py): a service that exits is restarted, at once
the first time, then after a back-off that doubles per quick crash (1 s, 2 s, 4 s ... capped at
30 s) and resets once the process has run for a minute. On a fake clock and fake processes:
no process is started."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from services import launcher


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakePopen:
    code: int | None = None

    def poll(self):
        return self.code


@dataclass
class FakeProc:
    name: str
    started_at: float
    popen: FakePopen = field(default_factory=FakePopen)
    log_path: Path = Path("/dev/null")


@dataclass
class FakeDeployment:
    procs: list
    said: list = field(default_factory=list)

    def say(self, line: str) -> None:
        self.said.append(line)


@pytest.fixture
def supervised(monkeypatch):
    clock = Clock()
    # the launcher's own view of the clock (not the time module every other thread uses)
    monkeypatch.setattr(launcher, "time", SimpleNamespace(monotonic=clock, time=time.time, sleep=time.sleep))
    spawned: list[tuple[str, float]] = []

    def spawn(dep, name):
        spawned.append((name, clock.now))
        return FakeProc(name, clock.now)

    monkeypatch.setattr(launcher, "spawn", spawn)
    monkeypatch.setattr(launcher, "write_state", lambda dep: None)
    dep = FakeDeployment([FakeProc("decode-0", clock.now), FakeProc("prefill-0", clock.now)])
    return launcher.Supervisor(dep), dep, clock, spawned


def crash_and_wait_restart(sup, dep, clock, name: str, step_s: float = 0.25, limit_s: float = 120.0) -> float:
    """Crash ``name`` now; poll every ``step_s`` of the fake clock; seconds until it was restarted."""
    proc = next(p for p in dep.procs if p.name == name)
    proc.popen.code = 1
    crashed = clock.now
    while clock.now - crashed <= limit_s:
        if name in sup.poll():
            return clock.now - crashed
        clock.now += step_s
    raise AssertionError(f"{name} was never restarted")


def test_quick_crashes_back_off_doubling_up_to_30_s(supervised):
    sup, dep, clock, spawned = supervised
    delays = [crash_and_wait_restart(sup, dep, clock, "decode-0") for _ in range(8)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert sup.restarts == {"decode-0": 8}
    assert [name for name, _ in spawned] == ["decode-0"] * 8  # the other service was left alone
    assert "restarting in 16s" in dep.said[5]


def test_the_back_off_resets_after_a_minute_of_running(supervised):
    sup, dep, clock, _ = supervised
    assert [crash_and_wait_restart(sup, dep, clock, "prefill-0") for _ in range(3)] == [0.0, 1.0, 2.0]
    clock.now += 61  # the restarted process runs for more than a minute
    assert sup.poll() == []
    assert crash_and_wait_restart(sup, dep, clock, "prefill-0") == 0.0  # at once again
    assert crash_and_wait_restart(sup, dep, clock, "prefill-0") == 1.0


def test_a_running_process_is_never_restarted(supervised):
    sup, dep, clock, spawned = supervised
    for _ in range(10):
        clock.now += 30
        assert sup.poll() == []
    assert spawned == [] and sup.restarts == {}
