"""What prefill and decode workers share: the engine on its own thread, the KV store, the
view of other workers' heartbeats, CPU pinning, progress reports, and prefix hits read from
the KV store."""

from __future__ import annotations

import asyncio
import os
import time

from engine.factory import build_engine
from engine.outputs import StepOutput
from services.common.engine_loop import EngineLoop
from services.common.runtime import RecentSet, Worker, raise_open_file_limit
from shared.bus import Bus
from shared.config import Settings, parse_cpus
from shared.deadline import deadline_exceeded, is_expired
from shared.hashing import num_reusable_blocks
from shared.kv import block_key, open_store
from shared.kv.ledger import ledger_for
from shared.messages import Abort, Heartbeat, Progress, RequestMeta
from shared.metrics import kv_metrics, stage_metrics
from shared.registry import WorkerRegistry

#: Seconds between Progress events for requests this worker holds before their first token.
PROGRESS_INTERVAL_S = 2.0
#: Seconds between sweeps for held requests past their deadline.
DEADLINE_SWEEP_S = 0.25


class ModelWorker(Worker):
    """Base of PrefillWorker and DecodeWorker. Subclasses implement ``_on_outputs``,
    ``_on_step_error`` and ``num_running`` and may extend ``setup``/``serve``."""

    #: whether the engine thread waits, after a step that finished prompts, for their KV
    #: hand-offs before its next step (CPU engines only: EngineLoop's ``hold_handoffs``); a
    #: subclass that sets it calls ``engine_loop.release_handoff`` for every such prompt
    holds_handoffs = False

    def __init__(self, settings: Settings, bus: Bus | None = None):
        super().__init__(settings, bus)
        self.engine_loop: EngineLoop | None = None  # the engine on its own thread, once setup() built it
        self.expired = RecentSet()  # requests stopped here at their deadline

    @property
    def num_running(self) -> int:
        """Requests this worker holds now (the heartbeat's ``num_running``)."""
        raise NotImplementedError

    def heartbeat_fields(self) -> dict:
        return {"num_running": self.num_running, "capacity": self.settings.max_num_seqs, **self.engine_heartbeat_fields()}

    async def before_drain(self) -> None:
        await super().before_drain()
        if self.engine_loop is not None:
            self.engine_loop.stop()
        if getattr(self, "worker_state", None) is not None:
            self.worker_state.close()

    async def setup(self) -> None:
        raise_open_file_limit()  # KV imports map one file per block (shared.kv.shm.get_views)
        if self.settings.cpu_affinity:
            os.sched_setaffinity(0, parse_cpus(self.settings.cpu_affinity))
        self.engine = await asyncio.to_thread(build_engine, self.settings)
        self.store = open_store(self.settings)
        self.ledger = ledger_for(self.store)  # the record of staged KV handles
        self.registry = WorkerRegistry(self.settings.heartbeat_timeout_s)
        self.gateways_seen: set[str] = set()
        self.metrics = stage_metrics(self.stage)
        self.kv_metrics = kv_metrics()
        self.waiting_first_token: dict[str, RequestMeta] = {}
        log = ""
        if self.settings.step_log_dir:
            os.makedirs(self.settings.step_log_dir, exist_ok=True)
            log = os.path.join(self.settings.step_log_dir, f"{self.settings.instance_id or self.stage}-{os.getpid()}.jsonl")
        self.worker_state, on_busy, before_step = None, None, None
        if self.settings.core_share and self.engine.device.type == "cpu" and self.stage in ("prefill", "decode"):
            import torch

            from services.common import core_share

            folder = core_share.share_dir(self.settings.shm_dir, self.settings.namespace)
            threads = torch.get_num_threads()
            self.worker_state = core_share.WorkerState(folder, self.settings.instance_id, threads, self.stage)
            on_busy = self.worker_state.set
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            before_step = core_share.StepThreads(folder, threads, cpus, own=self.worker_state.path).before_step
        self.engine_loop = EngineLoop(self.engine, asyncio.get_running_loop(), self._on_outputs, self._on_step_error,
                                      self.metrics, step_log=log,
                                      header={"stage": self.stage, "instance": self.settings.instance_id,
                                              "cpus": self.settings.cpu_affinity, "pid": os.getpid()},
                                      on_busy=on_busy, before_step=before_step,
                                      hold_handoffs=self.holds_handoffs and self.engine.device.type == "cpu").start()

    async def serve(self) -> None:
        async def on_heartbeat(hb) -> None:
            if isinstance(hb, Heartbeat):
                self.registry.observe(hb)
                if hb.stage == "gateway":
                    self.gateways_seen.add(hb.inbox)

        await self.bus.subscribe(self.protocol.heartbeat, on_heartbeat)
        self.spawn(self._progress_loop(), "progress")
        self.spawn(self._deadline_loop(), "deadlines")

    def engine_heartbeat_fields(self) -> dict:
        loop = self.engine_loop
        if loop is None:
            return {}
        return {"prefill_tokens_per_s": round(loop.prefill_tokens_per_s, 1),
                "decode_step_s": round(loop.decode_step_s, 5),
                "queued_prefill_tokens": loop.queued_prefill_tokens(),
                "kv_dtype": self.engine.layout.dtype,
                "kv_bytes_per_token": self.engine.bytes_per_token}

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        raise NotImplementedError

    def _on_step_error(self, request_ids: list[str], exc: Exception) -> None:
        raise NotImplementedError

    def held_requests(self) -> list[RequestMeta]:
        """The requests this worker holds now (queued in its engine or running)."""
        raise NotImplementedError

    async def _deadline_loop(self) -> None:
        """Every ``DEADLINE_SWEEP_S``: stop the requests held here whose deadline passed (as an
        Abort would: out of the engine at its next step) and tell their gateway
        ``deadline_exceeded`` — a gateway cut off from this worker would otherwise keep them
        running for nobody. A gateway that is alive has usually sent the Abort itself."""
        while True:
            await asyncio.sleep(DEADLINE_SWEEP_S)
            now = time.time()
            for meta in self.held_requests():
                if is_expired(meta.deadline_at, now) and meta.request_id not in self.expired:
                    self.expired.add(meta.request_id)
                    self.log.info("deadline_passed", request_id=meta.request_id)
                    await self.on_abort(Abort(request_id=meta.request_id, reason="deadline"))
                    await self.send_error(meta.reply_to, meta.request_id, deadline_exceeded(f"in {self.stage}"))

    async def _progress_loop(self) -> None:
        """Tell the gateways of requests still before their first token that they are being
        worked on: a long prefill (or a queue behind one) is busy, not stuck."""
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            for rid, meta in list(self.waiting_first_token.items()):
                self.post(meta.reply_to, Progress(request_id=rid, stage=self.stage))

    def pick_postfilter(self, request_id: str) -> str | None:
        """The inbox of the live postfilter instance that owns ``request_id``."""
        owner = self.registry.pick("postfilter", request_id)
        return owner.inbox if owner else None

    async def import_store_hits(self, request_id: str, block_hashes: list[bytes], num_prompt_tokens: int) -> int:
        """Blocks of a prompt that another worker already staged count as prefix hits: read
        the leading run this worker lacks from the store into its prefix cache, so the engine
        computes only the rest. Any failure just means computing more. Returns the number of
        prompt tokens imported."""
        if not self.settings.enable_prefix_caching:
            return 0
        hashes = block_hashes[: num_reusable_blocks(num_prompt_tokens, self.settings.block_size)]
        imported = await self.import_from_store(request_id, hashes, "store_prefix_lookup_failed")
        self.kv_metrics["prefix_hit_tokens"].labels(self.stage, "store").inc(imported * self.settings.block_size)
        return imported * self.settings.block_size

    async def import_from_store(self, request_id: str, hashes: list[bytes], failure_event: str) -> int:
        """Read the leading run of ``hashes`` (a prompt's full blocks, in order) that this
        worker's prefix cache lacks and the KV store holds, and put it into the prefix cache
        (the read in a thread, the copy into the pool on the engine thread, between steps).
        Stops at the first block the store lacks or when no pool block is free. Any failure is
        logged as ``failure_event`` and imports nothing. Returns the number of blocks imported."""
        num_local = self.engine.cached_block_hashes(hashes)
        wanted = hashes[num_local:]
        if not wanted:
            return 0
        dtype = self.engine.layout.dtype
        keys = [block_key(h, dtype) for h in wanted]
        started = time.perf_counter()
        try:
            present = await asyncio.to_thread(self.store.exists, keys)
            run = next((i for i, p in enumerate(present) if not p), len(present))
            if run == 0:
                return 0
            data = await asyncio.to_thread(self.store.get_views, keys[:run])
            run = next((i for i, d in enumerate(data) if d is None), len(data))
            if run == 0:
                return 0
            imported = await self.engine_loop.call(
                lambda e: e.import_cached_blocks(wanted[:run], data[:run], keep=hashes[:num_local]))
        except Exception as exc:
            self.log.warning(failure_event, request_id=request_id, error=str(exc))
            return 0
        self.kv_metrics["get_bytes"].inc(sum(len(d) for d in data[:run]))
        self.kv_metrics["get_seconds"].inc(time.perf_counter() - started)
        return imported
