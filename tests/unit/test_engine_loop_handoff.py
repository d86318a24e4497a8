"""The prefill worker's engine thread waits for a finished prompt's hand-off (its final KV put and
DecodeTask publish) before its next step (``EngineLoop(hold_handoffs=True)``): on a CPU the put's
thread and the next step's threads share the cores, and the put is on the request's first decode
gap. The wait ends at ``release_handoff`` or after ``HANDOFF_HOLD_S``; without the setting the
engine steps on."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from services.common import engine_loop as engine_loop_module
from services.common.engine_loop import EngineLoop
from shared.messages import SamplingParams


def run(tiny_model, hold: bool, release_after_s: float | None):
    """A long-running sequence "b" decodes while "a" is prefilled and exported (a hand-off).
    Returns (steps of "b" between a's export and its release (or the hold's end), steps of "b"
    after it, seconds from a's export to b's next step)."""
    engine = LLMEngine(copy.deepcopy(tiny_model[0]), EngineConfig(model_id="tiny", block_size=4, num_kv_blocks=256),
                       eos_token_ids=())
    seen: dict = {"exported_at": None, "b_after": [], "released_at": None}

    async def main():
        loop_ = asyncio.get_running_loop()
        done = asyncio.Event()

        def on_outputs(outs):
            now = time.perf_counter()
            for out in outs:
                if out.request_id == "a" and out.prompt_kv is not None:
                    seen["exported_at"] = now
                    if release_after_s is not None:
                        def release():
                            seen["released_at"] = time.perf_counter()
                            engine_loop.release_handoff("a")
                        loop_.call_later(release_after_s, release)
                elif out.request_id == "b" and seen["exported_at"] is not None:
                    seen["b_after"].append(now)
                if out.request_id == "b" and out.finished:
                    done.set()

        engine_loop = EngineLoop(engine, loop_, on_outputs, lambda ids, exc: None, hold_handoffs=hold)
        engine_loop.start()
        try:
            await engine_loop.call(lambda e: e.add_request("b", [5, 6, 7, 8], SamplingParams(max_tokens=400)))
            await asyncio.sleep(0.05)
            await engine_loop.call(lambda e: e.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=4),
                                                           stop_after_prefill=True))
            await asyncio.wait_for(done.wait(), 120)
        finally:
            engine_loop.stop()
        return engine_loop.held_seconds

    held_seconds = asyncio.run(main())
    assert seen["exported_at"] is not None, "the prompt was never exported"
    end = seen["released_at"]
    if end is None:
        end = seen["exported_at"] + engine_loop_module.HANDOFF_HOLD_S
    during = [t for t in seen["b_after"] if t < end - 0.01]
    after = [t for t in seen["b_after"] if t >= end]
    first_gap = seen["b_after"][0] - seen["exported_at"] if seen["b_after"] else float("inf")
    return len(during), len(after), first_gap, held_seconds


def test_the_next_step_waits_for_the_hand_off_until_released(tiny_model, monkeypatch):
    monkeypatch.setattr(engine_loop_module, "HANDOFF_HOLD_S", 30.0)
    during, after, first_gap, held = run(tiny_model, hold=True, release_after_s=0.3)
    assert during == 0  # no step while the hand-off was held
    assert after > 0  # and the engine went on once it was released
    assert 0.25 <= first_gap < 10.0
    assert 0.25 <= held < 10.0


def test_a_hand_off_never_released_holds_one_step_at_most(tiny_model, monkeypatch):
    monkeypatch.setattr(engine_loop_module, "HANDOFF_HOLD_S", 0.3)
    during, after, first_gap, held = run(tiny_model, hold=True, release_after_s=None)
    assert during == 0
    assert after > 10  # the later steps are not held
    assert 0.25 <= first_gap < 5.0
    assert 0.25 <= held < 5.0


@pytest.mark.parametrize("release_after_s", [0.3, None])
def test_without_the_setting_the_engine_steps_on(tiny_model, monkeypatch, release_after_s):
    monkeypatch.setattr(engine_loop_module, "HANDOFF_HOLD_S", 0.3)
    during, after, first_gap, held = run(tiny_model, hold=False, release_after_s=release_after_s)
    assert during > 0  # "b" kept decoding through the hand-off
    assert held == 0.0
