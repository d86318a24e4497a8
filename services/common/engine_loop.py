"""The engine on its own thread, so model steps never block the event loop (acks,
heartbeats and aborts keep flowing during a long prefill).

The event loop talks to the engine only through :meth:`EngineLoop.call` (run a function on
the engine thread between steps, get its result as an awaitable); the engine thread hands
step outputs back with ``loop.call_soon_threadsafe``. One command queue, one owner: the
engine needs no locks.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.engine import LLMEngine
from engine.outputs import StepOutput
from shared.logging import get_logger

log = get_logger(__name__)

#: Longest the engine thread waits, after a step with outputs, for the event loop to take them
#: before it starts the next step. The kernels let go of the GIL tens of times a step; an event
#: loop thread woken while no core is free (the step's OpenMP threads hold both on a small
#: machine) finds it taken again each time it gets to run, and its tokens waited a whole step
#: (issue 12: hand-off 19.7 ms mean against 3.8 ms with the GIL held through each call). A
#: blocked engine thread frees its core and the GIL. Bounded, so a busy loop costs a step at
#: most this much.
HANDOFF_WAIT_S = 0.002

#: Longest the engine thread waits, before its next step, for the hand-offs of the prompts its
#: last step finished (their final KV put and DecodeTask publish, :meth:`EngineLoop.release_handoff`)
#: where ``hold_handoffs`` is on. On a CPU the put's thread shares the cores with the next step's
#: threads: in the long-prompt burst (``pdserve bench longmix``, Intel Xeon without AMX tiles, 2
#: vCPU) a final put of 16-24 blocks took 45-107 ms of wall time for ~4-22 ms of its thread's CPU,
#: and each such millisecond is one more of the request's first decode gap (docs/decisions.md,
#: "The hand-off's put before the next prefill step"). Bounded, so a slow store (Redis across a
#: network) costs a step at most this much.
HANDOFF_HOLD_S = 0.2

#: Prefill steps a new worker runs before it times its prefill rate. Its first one runs cold
#: (first touch of the KV pool and the kernels' buffers): 4 prompts of 33 tokens took 791 ms
#: against 173-236 ms for the same step later (Intel Xeon, AVX-512 without BF16, 2 vCPU,
#: 2026-12-06), and as the EWMA's first value it stayed the rate the gateway predicted with until
#: later steps moved it: ``pdserve bench longmix`` right after its warm-up saw 68 tokens/s, a
#: predicted 518 s queue, and 5 of 16 prompts refused as unable to meet their deadline, in a burst
#: served in about a minute.
COLD_PREFILL_STEPS = 1


class EngineLoop:
    """Runs ``engine.step()`` while there is work, and queued calls between steps.

    Args:
        engine: the engine (owned by this loop's thread from ``start()`` on).
        loop: the asyncio loop that receives outputs.
        on_outputs: called on the event loop with each non-empty list of step outputs.
        on_step_error: called on the event loop with the request ids of a step that raised;
            those requests have been aborted in the engine.
        metrics: the stage's StageMetrics (step time, tokens and sequences per step).
        step_log: a file to append one JSON line per engine step to (``PD_STEP_LOG_DIR``):
            ``[start, seconds, [[chunk, context], ...], decode batch, decode context]``, start on
            the host's monotonic clock (``time.perf_counter``, comparable across its processes);
            the first line says who wrote it (``{"header": {...}}``). Written every second.
        on_busy: called on the engine thread with True when work arrives after idling and False
            when the engine runs out of work (:class:`services.common.core_share.WorkerState`).
        before_step: called on the engine thread before each step
            (:class:`services.common.core_share.StepThreads`).
        hold_handoffs: after a step whose outputs carry exported prompt KV (a prefill worker's
            hand-offs), wait before the next step until each is released
            (:meth:`release_handoff`), at most :data:`HANDOFF_HOLD_S`.
    """

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[StepOutput]], None],
        on_step_error: Callable[[list[str], Exception], None],
        metrics=None,
        step_log: str = "",
        header: dict | None = None,
        on_busy: Callable[[bool], None] | None = None,
        before_step: Callable[[], object] | None = None,
        hold_handoffs: bool = False,
    ):
        self.engine = engine
        self.metrics = metrics
        self.loop = loop
        self.on_outputs = on_outputs
        self.on_step_error = on_step_error
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._delivered = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.last_step_at = time.monotonic()
        self.busy_seconds = 0.0
        self.prefill_tokens_per_s = 0.0
        self.decode_step_s = 0.0
        self._cold_prefill_steps = COLD_PREFILL_STEPS  # prefill steps left before the rate is timed
        self._spec_seen = (0, 0)  # engine.stats (num_draft_tokens, num_accepted_tokens) last reported
        self._log_path, self._log_at = step_log, 0.0
        self.on_busy, self.before_step = on_busy, before_step
        self.hold_handoffs = hold_handoffs
        self._held: set[str] = set()  # request ids whose hand-off the next step waits for
        self._held_cv = threading.Condition()
        self.held_seconds = 0.0  # time the engine thread waited for hand-offs (all told)
        if step_log:
            engine.step_log = []
            with open(step_log, "a") as f:
                f.write(json.dumps({"header": header or {}}) + "\n")

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._calls.put(None)
        self._thread.join(timeout=10)
        self._flush_log()

    def _flush_log(self) -> None:
        """Append the steps recorded since the last flush to the step log (engine thread, or
        after it stopped)."""
        records = self.engine.step_log
        if not records:
            return
        self.engine.step_log = []
        with open(self._log_path, "a") as f:
            f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread before its next step."""
        fut = self.loop.create_future()
        self._calls.put((fn, fut))
        return fut

    def release_handoff(self, request_id: str) -> None:
        """The hand-off of ``request_id`` (its final KV put and DecodeTask publish) is done, or
        will not happen: the engine thread need not wait for it. Any thread; a no-op for a request
        not held."""
        with self._held_cv:
            self._held.discard(request_id)
            if not self._held:
                self._held_cv.notify_all()

    def _wait_handoffs(self) -> None:
        """On the engine thread, before a step: wait for the held hand-offs, at most
        :data:`HANDOFF_HOLD_S`; those still held after it no longer hold any step. Ids are added
        on this thread only (other threads only release), so an empty set read without the lock
        stays empty: a step with nothing held takes no lock."""
        if not self._held:
            return
        with self._held_cv:
            started = time.perf_counter()
            self._held_cv.wait_for(lambda: not self._held or self._stop.is_set(), timeout=HANDOFF_HOLD_S)
            self._held.clear()
            held = time.perf_counter() - started
        self.held_seconds += held
        if self.metrics is not None:
            self.metrics.handoff_hold_seconds.inc(held)

    def _resolve(self, fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
        def done() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self.loop.call_soon_threadsafe(done)

    def _drain_calls(self, block: bool) -> None:
        first = True
        while True:
            try:
                item = self._calls.get(block=block and first, timeout=0.1 if block and first else None)
            except queue.Empty:
                return
            first = False
            if item is None:
                return
            fn, fut = item
            try:
                self._resolve(fut, fn(self.engine))
            except BaseException as exc:  # handed to the awaiting coroutine
                self._resolve(fut, exc=exc)

    def _observe_rates(self, elapsed: float) -> None:
        """EWMAs of the prefill rate (steps that computed many tokens) and the decode step
        time (steps of single-token sequences only), for the router's cost model and the
        gateway's admission. The first :data:`COLD_PREFILL_STEPS` prefill steps are not timed."""
        stats = self.engine.stats
        tokens, seqs = stats.last_step_tokens, stats.last_step_seqs
        if tokens >= 32 and elapsed > 0:
            if self._cold_prefill_steps > 0:
                self._cold_prefill_steps -= 1
                return
            rate = tokens / elapsed
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else 0.8 * self.prefill_tokens_per_s + 0.2 * rate
        elif tokens == seqs and tokens > 0:
            self.decode_step_s = elapsed if not self.decode_step_s else 0.8 * self.decode_step_s + 0.2 * elapsed

    def _observe_speculation(self, outputs: list[StepOutput]) -> None:
        """Draft and accepted tokens since the last step (engine/speculative.py), and how many
        output tokens each decoding sequence got."""
        stats, metrics = self.engine.stats, self.metrics
        drafted = stats.num_draft_tokens - self._spec_seen[0]
        if drafted:
            metrics.spec_draft_tokens.inc(drafted)
            metrics.spec_accepted_tokens.inc(stats.num_accepted_tokens - self._spec_seen[1])
            self._spec_seen = (stats.num_draft_tokens, stats.num_accepted_tokens)
            metrics.spec_acceptance_ratio.set(stats.num_accepted_tokens / stats.num_draft_tokens)
        for out in outputs:
            if out.index > 0:
                metrics.seq_step_tokens.observe(len(out.new_token_ids))

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens the engine has still to compute (a read across threads: a hint)."""
        total = 0
        for seq in list(self.engine.sequences.values()):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                total += seq.num_prompt_tokens - seq.num_computed_tokens
        return total

    def _report_pool(self) -> None:
        if self.metrics is not None:
            bm = self.engine.block_manager
            self.metrics.kv_blocks_used.set(bm.num_blocks - bm.num_free_blocks)

    def _run(self) -> None:
        engine = self.engine
        if self.metrics is not None:
            self.metrics.kv_blocks_total.set(engine.block_manager.num_blocks)
        while not self._stop.is_set():
            idle = not engine.has_unfinished()
            if idle and self.on_busy is not None:
                self.on_busy(False)
            self._drain_calls(block=idle)
            self._report_pool()
            if self._stop.is_set() or not engine.has_unfinished():
                continue
            if self.on_busy is not None:
                self.on_busy(True)
            self._wait_handoffs()
            if self.before_step is not None:
                self.before_step()
            started = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as exc:
                log.exception("engine_step_failed")
                ids = list(engine.sequences)
                for request_id in ids:
                    engine.abort(request_id)
                self.loop.call_soon_threadsafe(self.on_step_error, ids, exc)
                continue
            elapsed = time.perf_counter() - started
            self._observe_rates(elapsed)
            self.busy_seconds += elapsed
            self.last_step_at = time.monotonic()
            if self.metrics is not None:
                self.metrics.step_seconds.observe(elapsed)
                self.metrics.step_tokens.observe(engine.stats.last_step_tokens)
                self.metrics.batch_size.observe(engine.stats.last_step_seqs)
                self._observe_speculation(outputs)
            if outputs:
                if self.hold_handoffs:
                    held = [out.request_id for out in outputs if out.prompt_kv is not None]
                    if held:
                        with self._held_cv:  # before the outputs are delivered: a release follows them
                            self._held.update(held)
                self._delivered.clear()
                self.loop.call_soon_threadsafe(self._deliver, outputs, time.perf_counter())
                self._delivered.wait(HANDOFF_WAIT_S)
            if self._log_path and self.last_step_at - self._log_at > 1.0:
                self._log_at = self.last_step_at
                self._flush_log()

    def _deliver(self, outputs: list[StepOutput], ready_at: float) -> None:
        """On the event loop: hand a step's outputs on, timing the thread hand-off; then let
        the engine thread go on to its next step."""
        try:
            if self.metrics is not None:
                self.metrics.handoff_seconds.observe(time.perf_counter() - ready_at)
            self.on_outputs(outputs)
        finally:
            self._delivered.set()
