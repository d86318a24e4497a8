"""One simulated model worker: the engine's real :class:`~engine.scheduler.Scheduler` and
:class:`~engine.block_manager.BlockManager` decide every step; the profile says how long it takes.

Speed: a step in which every scheduled sequence decodes one token, nothing was preempted and
nothing waiting could be admitted is followed by more such steps until a sequence finishes, the
KV pool runs short or something arrives — the scheduler's state cannot change in between. The
worker runs such a run of ``k`` steps as one *segment*: one event, one block allocation per
sequence for ``k`` tokens, step times in closed form (the decode step time grows linearly with
the context, :class:`~sim.profile.CostModel`). An arrival (or a change of what the
host's other workers are doing) cuts the segment after the step in progress, as a real worker
takes new work only between steps. Results are those of ``k`` single steps, except which
block ids were taken.
"""

from __future__ import annotations

import hashlib
import math

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from shared.hashing import num_reusable_blocks
from shared.messages import SamplingParams
from sim.profile import CostModel

_SAMPLING = SamplingParams(max_tokens=1 << 30, ignore_eos=True)


class SimSeq(Sequence):
    """A :class:`Sequence` with the simulator's per-request bookkeeping."""

    __slots__ = ("req", "last_t", "max_out", "kv_bytes", "store_hits")

    def update_block_hashes(self) -> None:
        """Name blocks past the trace's prompt hashes (output blocks, all placeholder tokens) by
        their parent's hash alone: unique per prefix, as the engine's are, without hashing
        placeholder token ids (a sixth of the simulator's time on long-output traces)."""
        hashes = self.block_hashes
        num_full = len(self.token_ids) // self.block_size
        while len(hashes) < num_full:
            parent = hashes[-1] if hashes else b""
            hashes.append(hashlib.blake2b(parent, digest_size=16, person=b"pdserve-sim-out").digest())


def new_seq(req, block_size: int, hashes: list[bytes], prefill_only: bool) -> SimSeq:
    """A sequence for ``req`` (a :class:`~sim.trace.SimRequest`) whose token ids are
    placeholders: only counts and ``hashes`` matter to the scheduler and block manager."""
    seq = SimSeq(str(req.idx), [0] * req.prompt_tokens, req.prompt_tokens, _SAMPLING, block_size,
                 block_hashes=hashes, stop_after_prefill=prefill_only, arrival_at=req.arrival_s)
    seq.req, seq.last_t, seq.max_out, seq.kv_bytes = req, -1.0, req.max_tokens, 0
    seq.store_hits = ()  # a new prompt's leading blocks read from the KV store before admission
    return seq


def leading_hits(bm: BlockManager, hashes) -> int:
    """How many of ``hashes``' leading blocks ``bm``'s prefix cache holds."""
    n = 0
    for h in hashes:
        if bm.lookup(h) is None:
            break
        n += 1
    return n


class Host:
    """A machine's cores, shared by its model workers and the pipeline's services.

    A step's time is multiplied by :meth:`factor`: ``corun_slowdown`` when another worker of the
    host is busy (shared memory bandwidth), and — unless ``cores`` is 0 (not modelled: a
    GPU-class worker, or a calibrated run whose contention is in the fitted co-run ratio) —
    processor sharing when busy workers plus the services' CPU demand (tokenizer, detokenize,
    SSE: an exponential average over ``tau_s``) exceed the cores.
    """

    def __init__(self, cores: int, corun_slowdown: float = 1.0, tau_s: float = 2.0):
        self.cores, self.corun, self.tau = cores, corun_slowdown, tau_s
        self.workers: list[SimWorker] = []
        self._acc, self._at = 0.0, 0.0

    def add_cpu(self, now: float, seconds: float) -> None:
        if self.cores:
            self._acc = self._acc * math.exp(-(now - self._at) / self.tau) + seconds
            self._at = now

    def service_load(self, now: float) -> float:
        """CPU-seconds per second the services use now."""
        return self._acc * math.exp(-(now - self._at) / self.tau) / self.tau

    def factor(self, now: float, worker: SimWorker) -> float:
        if len(self.workers) < 2 and not self.cores:
            return 1.0
        busy = sum(1 for w in self.workers if w.busy and w is not worker) + 1
        f = self.corun if busy > 1 else 1.0
        if not self.cores:
            return f
        demand = busy + self.service_load(now)
        return f * max(1.0, demand / self.cores)


class SimWorker:
    """A prefill, decode or aggregated worker. ``sim`` is the :class:`Simulation` (events, outputs)."""

    def __init__(self, sim, name: str, role: str, cost: CostModel, host: Host, *, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_prefill_chunk_tokens: int,
                 enable_prefix_caching: bool = True):
        self.sim, self.name, self.role, self.cost, self.host = sim, name, role, cost, host
        host.workers.append(self)
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, max_prefill_chunk_tokens)
        self.block_size = block_size
        self.inbox: list[tuple[str, SimSeq]] = []  # ("new" | "kv", seq) taken between steps
        self.prefetches: list[tuple[tuple, tuple]] = []  # (keep, blocks) read ahead (PD_KV_PREFETCH)
        self.import_s = 0.0  # engine-thread seconds spent importing loaded KV
        self.pending = 0  # work items this worker has fetched that are still on their way (hop, KV get)
        self.max_num_seqs = max_num_seqs
        self.busy = False
        self.busy_s = 0.0
        self.extra_s = 0.0  # worker-loop time before the next step (KV staging/loading)
        self.version = 0  # bumps when the pending segment event is replaced
        self.seg = None  # (t0, k, t1, dt, factor, plan) of the segment in flight
        # EWMA tokens/s of steps of ≥ 32 tokens, as EngineLoop reports it; a replay of a measured
        # run starts from what the real worker's warm-up left (Topology.extra["prefill_rates"]:
        # by worker name, "*" for every worker not named)
        rates = sim.topo.extra.get("prefill_rates", {})
        self.prefill_rate = float(rates.get(name, rates.get("*", 0.0)))

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens this worker has still to compute, as ``EngineLoop.queued_prefill_tokens``
        reports them in heartbeats: every sequence it holds (a prompt's prefix-cache hits count
        until it is scheduled, as in the engine) and the prompts in its inbox."""
        total = sum(seq.num_prompt_tokens for kind, seq in self.inbox if kind == "new")
        for seq in self.sched.waiting:
            total += seq.num_prompt_tokens - seq.num_computed_tokens
        for seq in self.sched.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                total += seq.num_prompt_tokens - seq.num_computed_tokens
        return total

    # --- arrivals ---------------------------------------------------------------------
    def deliver(self, now: float, kind: str, seq: SimSeq) -> None:
        self.inbox.append((kind, seq))
        if not self.busy:
            self.start(now)
        else:
            self.cut(now)

    def _take_inbox(self) -> None:
        if self.prefetches:
            self._take_prefetches()
        for kind, seq in self.inbox:
            if kind == "new":
                if seq.store_hits:
                    self._import_store_hits(seq)
                self.sched.add(seq)
                continue
            # admit_with_kv on the engine thread: full blocks this worker's prefix cache holds
            # are reused, the rest (read from the store in a thread: seq.kv_bytes) are copied in
            imp = self.cost.kv_import(seq.kv_bytes)
            self.extra_s += imp
            self.import_s += imp
            bs = self.block_size
            full = seq.num_prompt_tokens // bs
            seq.num_computed_tokens = 0  # the counts are this worker's from here
            hits = [self.bm.lookup(h) for h in seq.block_hashes[:leading_hits(self.bm, seq.block_hashes[:full])]]
            if self.bm.can_allocate(seq, seq.num_prompt_tokens - len(hits) * bs + 1, hits):
                self.bm.allocate(seq, seq.num_prompt_tokens - len(hits) * bs + 1, hits)
                seq.num_computed_tokens = seq.num_prompt_tokens
                self.bm.cache_full_blocks(seq)
                self.sched.add_running(seq)
            else:  # no room to load: recompute (the engine's fallback)
                self.sched.add(seq)
        self.inbox.clear()

    def prefetched(self, now: float, keep: tuple, blocks: tuple) -> None:
        """Blocks read ahead of their DecodeTask (``PD_KV_PREFETCH``) become free cached blocks
        of this worker's prefix cache on its engine thread (``LLMEngine.import_cached_blocks``):
        at once when the engine is idle, else at the next step boundary, that step then
        starting later by the copy (:meth:`CostModel.kv_import`)."""
        self.prefetches.append((keep, blocks))
        if not self.busy:
            self._take_prefetches(charge=False)
        else:
            self.cut(now)  # a segment of steps ends at the step boundary where the import runs

    def _take_prefetches(self, charge: bool = True) -> None:
        for keep, blocks in self.prefetches:
            imported = self.bm.import_blocks(blocks, keep)
            imp = self.cost.kv_import(imported * self.block_size * self.sim.p.kv_bytes_per_token)
            self.import_s += imp
            if charge:
                self.extra_s += imp
        self.prefetches.clear()

    def _import_store_hits(self, seq: SimSeq) -> None:
        """``ModelWorker.import_store_hits``: the leading blocks of a new prompt that another
        worker staged (read in a thread: ``seq.kv_bytes``) become free cached blocks of this
        worker's prefix cache on the engine thread (``BlockManager.import_blocks``, as
        ``LLMEngine.import_cached_blocks`` calls it), so the prompt computes only the rest."""
        bs = self.block_size
        usable = seq.block_hashes[: num_reusable_blocks(seq.num_prompt_tokens, bs)]
        keep = usable[: usable.index(seq.store_hits[0])]  # the read took the run after the local hits
        imported = self.bm.import_blocks(seq.store_hits, keep)
        imp = self.cost.kv_import(imported * bs * self.sim.p.kv_bytes_per_token)
        self.extra_s += imp
        self.import_s += imp
        seq.store_hits, seq.kv_bytes = (), 0

    # --- steps ------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """Begin the next step (or segment) at ``now``, or go idle."""
        self._take_inbox()
        plan = self.sched.schedule()
        if plan.is_empty:
            if self.extra_s:
                self.busy_s += self.extra_s
                self.extra_s = 0.0
            if self.busy:
                self.busy = False
                self.sim.host_changed(now, self)
            return
        if not self.busy:
            self.busy = True
            self.sim.host_changed(now, self)
        prefill, batch, ctx = [], 0, 0
        for item in plan.scheduled:
            s = item.seq
            if item.num_new_tokens == 1 and s.num_tokens > s.num_prompt_tokens:
                batch += 1
                ctx += s.num_computed_tokens
            else:
                prefill.append((item.num_new_tokens, s.num_computed_tokens))
        f = self.host.factor(now, self) * self.sim.load_factor(now)
        k = 1
        if not prefill and not plan.preempted:
            k = self._segment_length(plan, batch)
        t1 = self.cost.step(prefill, batch, ctx) * f
        if k == 1 and not prefill and self.sim.jitter:  # decode steps; a segment's take their mean (sim.tokens spreads its gaps)
            t1 *= self.sim.jitter_factor()
        dt = self.cost.decode_step(batch, batch) * f - self.cost.decode_step(batch, 0) * f if not prefill else 0.0
        t0 = now + self.extra_s
        self.busy_s += self.extra_s
        self.extra_s = 0.0
        self.seg = (t0, k, t1, dt, plan)
        self.version += 1
        self.sim.push(t0 + self._cum(t1, dt, k), self._end, self.version)

    @staticmethod
    def _cum(t1: float, dt: float, j: int) -> float:
        """Seconds of the first ``j`` steps of a segment (step i takes t1 + (i-1)·dt)."""
        return j * t1 + dt * j * (j - 1) / 2

    def _segment_length(self, plan, batch: int) -> int:
        seqs = [it.seq for it in plan.scheduled]
        k = min(s.max_out - s.num_output_tokens for s in seqs)
        k = min(k, self.sim.max_segment)
        if k <= 1:
            return 1
        free = self.bm.num_free_blocks
        bs = self.block_size

        def need(j: int) -> int:  # blocks for j-1 more tokens beyond the first step's
            return sum(max(0, -(-(s.num_computed_tokens + j) // bs) - len(s.block_table)) for s in seqs)

        if need(k) > free:
            lo, hi = 1, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if need(mid) <= free else (lo, mid - 1)
            k = lo
        return k

    def cut(self, now: float) -> None:
        """End the segment in flight after the step in progress at ``now``."""
        if self.seg is None:
            return
        t0, k, t1, dt, plan = self.seg
        if k <= 1 or now >= t0 + self._cum(t1, dt, k):
            return
        j = 1
        # smallest j with cum(j) >= now - t0 (the step in progress finishes); a segment that has
        # not begun yet (t0 = its start after a KV import, later than now) keeps its first step
        x = max(0.0, now - t0)
        if dt > 0:
            j = math.ceil((-(t1 - dt / 2) + math.sqrt((t1 - dt / 2) ** 2 + 2 * dt * x)) / dt)
        else:
            j = math.ceil(x / t1) if t1 > 0 else 1
        j = max(1, min(k, j))
        if j == k:
            return
        self.seg = (t0, j, t1, dt, plan)
        self.version += 1
        self.sim.push(t0 + self._cum(t1, dt, j), self._end, self.version)

    def _end(self, now: float, version: int) -> None:
        if version != self.version:
            return
        t0, k, t1, dt, plan = self.seg
        self.seg = None
        self.busy_s += now - t0
        if k == 1 and now > t0:  # services/common/engine_loop.py EngineLoop._observe_rates
            tokens = sum(it.num_new_tokens for it in plan.scheduled)
            if tokens >= 32:
                rate = tokens / (now - t0)
                self.prefill_rate = rate if not self.prefill_rate else 0.8 * self.prefill_rate + 0.2 * rate
        sim = self.sim
        for item in plan.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            samples = item.samples
            seq.num_computed_tokens += item.num_new_tokens
            if not samples:
                self.bm.cache_full_blocks(seq)
                if seq.stop_after_prefill and sim.topo.kv_stage_during_prefill:
                    sim.stage_blocks(now, seq, self)
                continue
            first_end = t0 + t1
            if k > 1:
                if -(-(seq.num_computed_tokens + k - 1) // self.block_size) > len(seq.block_table):
                    self.bm.allocate(seq, k - 1)
                seq.num_computed_tokens += k - 1
                seq.token_ids.extend([0] * k)
            else:
                seq.token_ids.append(0)
            seq.update_block_hashes()
            if item.num_new_tokens > 1:  # a prompt just completed: its blocks become findable
                self.bm.cache_full_blocks(seq)
            sim.tokens(seq, first_end, now, k, self.host, t1)
            if seq.stop_after_prefill:
                self.sched.finish(seq, None)
                if seq.num_output_tokens < seq.max_out:
                    sim.hand_off(now, seq, self)  # staged in a thread: this engine steps on
                else:
                    sim.finished(seq, now)
            elif seq.num_output_tokens >= seq.max_out:
                self.sched.finish(seq, "length")
                sim.finished(seq, now)
        sim.room(now, self)
        self.start(now)
