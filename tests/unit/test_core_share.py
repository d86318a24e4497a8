"""Cores where the work is (services/common/core_share.py): a model worker's threads follow its
host's other model workers — their threads lent while they idle or are dead, taken back while they
work, in both directions (prefill borrows from decode, decode from prefill) — and a worker's engine
loop publishes busy and idle at the right moments."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import time

import pytest

from services.common import core_share
from services.common.core_share import StepThreads, WorkerState


@pytest.fixture(autouse=True)
def _lend_at_once(monkeypatch):
    monkeypatch.setattr(core_share, "LEND_AFTER_S", 0.0)  # test_lending_waits_for_a_settled_idle sets it


def _look(p: StepThreads) -> int:
    p._looked = -1e9  # as if LOOK_EVERY_S had passed
    return p.before_step()


def test_prefill_threads_follow_the_decode_workers(tmp_path):
    folder = core_share.share_dir(str(tmp_path), "ns")
    applied: list[int] = []
    prefill = StepThreads(folder, base=1, max_threads=4, set_threads=applied.append)
    assert _look(prefill) == 1 and applied == []  # no decode worker on this host: its own share
    a, b = WorkerState(folder, "decode-0-aa", threads=1), WorkerState(folder, "decode-1-bb", threads=2)
    assert _look(prefill) == 4 and applied == [4]  # both idle: 1 + 1 + 2
    a.set(True)  # a decodes, and may borrow too: b's two threads are split between a and the prefill worker
    assert _look(prefill) == 2
    b.set(True)
    assert _look(prefill) == 1
    b.set(False)
    assert _look(prefill) == 2 and applied == [4, 2, 1, 2]
    capped = StepThreads(folder, base=1, max_threads=2, set_threads=applied.append)
    assert _look(capped) == 2  # never more threads than its CPUs
    a.close()
    b.close()
    assert _look(prefill) == 1 and os.listdir(folder) == []


def test_decode_borrows_an_idle_prefill_workers_threads_and_gives_them_back(tmp_path):
    """Both ways at once, as pdserve up runs them on two cores: each worker publishes its own state
    and borrows from the other, never counting itself."""
    folder = core_share.share_dir(str(tmp_path), "ns")
    prefill_state = WorkerState(folder, "prefill-0-aa", threads=1, role="prefill")
    decode_state = WorkerState(folder, "decode-0-bb", threads=1, role="decode")
    prefill = StepThreads(folder, base=1, max_threads=2, set_threads=lambda n: None, own=prefill_state.path)
    decode = StepThreads(folder, base=1, max_threads=2, set_threads=lambda n: None, own=decode_state.path)
    decode_state.set(True)  # one stream decoding, no prompt in prefill
    assert _look(decode) == 2 and _look(prefill) == 1
    prefill_state.set(True)  # a long prompt arrives: the prefill worker takes its core back
    assert _look(prefill) == 1 and _look(decode) == 1
    decode_state.set(False)  # the stream ended: the prompt gets both cores
    assert _look(prefill) == 2
    prefill_state.close()
    assert _look(decode) == 1  # a worker that left (drained) lends nothing: its file is gone


def test_lending_waits_for_a_settled_idle(tmp_path, monkeypatch):
    """A worker idle for less than LEND_AFTER_S lends nothing (a short prompt passing through
    prefill must not flip the decode worker's threads); a dead one lends at once."""
    monkeypatch.setattr(core_share, "LEND_AFTER_S", 0.2)
    folder = core_share.share_dir(str(tmp_path), "ns")
    other = WorkerState(folder, "prefill-0-aa", threads=1, role="prefill")
    me = StepThreads(folder, base=1, max_threads=2, set_threads=lambda n: None)
    assert _look(me) == 1  # idle only just now
    time.sleep(0.25)
    assert _look(me) == 2
    other.set(True)
    other.set(False)
    assert _look(me) == 1  # idle again, but not yet for long


def test_no_thread_is_borrowed_twice(tmp_path):
    """Three model workers of one thread each on two CPUs: whichever are busy, the threads they run
    add up to at most the host's (two busy workers split one idle worker's thread, never both
    take it), and each idle thread goes to exactly one borrower."""
    folder = core_share.share_dir(str(tmp_path), "ns")
    names = ["prefill-0-aa", "decode-0-bb", "decode-1-cc"]
    states = {n: WorkerState(folder, n, threads=1) for n in names}
    steppers = {n: StepThreads(folder, base=1, max_threads=2, set_threads=lambda k: None, own=states[n].path)
                for n in names}
    for busy in ([names[0]], names[:2], names[1:], [names[0], names[2]], names):
        for n in names:
            states[n].set(n in busy)
        threads = {n: _look(steppers[n]) for n in busy}
        borrowed = sum(t - 1 for t in threads.values())
        idle = len(names) - len(busy)
        assert all(t <= 2 for t in threads.values()), (busy, threads)  # never more than its CPUs
        assert borrowed == (min(idle, 1) if len(busy) == 1 else idle), (busy, threads)  # each idle thread once


def test_malformed_state_files_are_skipped(tmp_path):
    folder = core_share.share_dir(str(tmp_path), "ns")
    folder.mkdir(parents=True)
    (folder / "a.json").write_text(json.dumps({"pid": os.getpid(), "threads": 1, "busy": False, "since": None}))
    (folder / "b.json").write_text(json.dumps({"threads": 1, "busy": False}))  # no pid: not a worker's file
    (folder / "c.json").write_text(json.dumps(["not", "a", "state"]))
    me = StepThreads(folder, base=1, max_threads=4, set_threads=lambda n: None)
    assert _look(me) == 2  # only a (an older file: no since, lent at once)


def test_a_dead_busy_decode_worker_lends_its_threads_and_its_file_goes(tmp_path):
    folder = core_share.share_dir(str(tmp_path), "ns")
    folder.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / "decode-0-dead.json").write_text(json.dumps({"pid": int(dead.stdout), "threads": 1, "busy": True}))
    (folder / "decode-1-torn.json").write_text("{")  # being replaced: skipped, not fatal
    prefill = StepThreads(folder, base=1, max_threads=2, set_threads=lambda n: None)
    assert _look(prefill) == 2
    assert not (folder / "decode-0-dead.json").exists()


def test_looks_are_rate_limited(tmp_path, monkeypatch):
    monkeypatch.setattr(core_share, "LOOK_EVERY_S", 0.3)  # long enough for a loaded machine's file writes
    folder = core_share.share_dir(str(tmp_path), "ns")
    prefill = StepThreads(folder, base=1, max_threads=2, set_threads=lambda n: None)
    assert prefill.before_step() == 1
    WorkerState(folder, "d", threads=1)
    assert prefill.before_step() == 1  # within LOOK_EVERY_S of the last look
    time.sleep(core_share.LOOK_EVERY_S * 2)
    assert prefill.before_step() == 2


def test_engine_loop_publishes_busy_while_it_has_work(tiny_model):
    """The decode worker's hook: busy from the first step of a burst of work, idle once the engine has
    nothing left; a look from a prefill worker meanwhile sees the decode worker's thread taken."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from services.common.engine_loop import EngineLoop
    from shared.messages import SamplingParams

    engine = LLMEngine(copy.deepcopy(tiny_model[0]), EngineConfig(model_id="tiny", block_size=4, num_kv_blocks=256), eos_token_ids=())
    events: list[tuple[bool, bool]] = []

    async def main():
        done = asyncio.Event()
        finished = []

        def on_outputs(outs):
            finished.extend(o for o in outs if o.finished)
            if len(finished) == 2:
                done.set()

        loop = EngineLoop(engine, asyncio.get_running_loop(), on_outputs, lambda ids, exc: None,
                          on_busy=lambda busy: events.append((busy, engine.has_unfinished())))
        loop.start()
        try:
            await asyncio.sleep(0.05)
            for rid in ("a", "b"):
                await loop.call(lambda e, r=rid: e.add_request(r, [5, 6, 7, 8], SamplingParams(max_tokens=6)))
            await asyncio.wait_for(done.wait(), 60)
            await asyncio.sleep(0.05)
        finally:
            loop.stop()

    asyncio.run(main())
    assert events[0] == (False, False)  # idle at the start
    assert (True, True) in events  # busy while it had sequences
    busy_at = events.index((True, True))
    assert events[-1] == (False, False) and events.index((False, False), busy_at) > busy_at
