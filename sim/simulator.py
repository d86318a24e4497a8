"""Discrete-event simulation of a pdserve deployment replaying a trace.

``simulate(requests, topology, profile)`` runs every request through the pipeline the real
system has (``docs/architecture.md``):

    client → gateway → (bus hop) → tokenizer (one FIFO server per replica) → router
      ├─ remote: (hop) → prefill worker → first token; its staging thread puts the KV (jobs on
      │          the store's FIFO server: each chunk's full blocks as the chunk ends, the rest
      │          after the first token) → (hop) → a decode worker with room fetches the task, its
      │          thread gets the blocks it lacks (the store's server again), its engine thread
      │          imports them before its next step
      └─ local:  (hop) → decode/aggregated worker prefills and decodes
    each token: worker step end → (hop) postfilter detokenize → gateway SSE → client

Model workers are :class:`~sim.worker.SimWorker` (the engine's real Scheduler and
BlockManager); the conditional route is the tokenizer's real :class:`~services.tokenizer.router.Router`
fed heartbeats built from the simulated workers' state. A pool's work items wait in its stream
while every worker holds ``max_num_seqs`` (its consumer fetches no more), as JetStream's do. Workers sit on :class:`Host` s whose
cores they share with the services (the CPU cost per token and per request of the profile).

Outputs (:class:`SimResult`): TTFT, ITL (every gap), TPOT and E2E percentiles, goodput under
SLOs, per-worker utilization, and the simulator's own speed.
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field

from services.gateway.tenancy.waits import WaitAdmission
from services.tokenizer.router import Router
from shared.config import Settings
from shared.hashing import num_reusable_blocks
from shared.messages import Heartbeat
from sim.metrics import SimResult, summarize
from sim.profile import CostModel, Profile
from sim.worker import Host, SimWorker, leading_hits, new_seq


@dataclass
class Topology:
    """What to simulate.

    Attributes:
        mode: ``aggregated`` (``workers`` aggregated workers), ``disaggregated`` (``prefill``
            + ``decode`` workers) or ``conditional`` (the same, routed per request).
        workers, prefill, decode: worker counts.
        host_cores: cores per host (0 = processor sharing not modelled: a GPU-class worker, or
            a calibrated replay whose contention is in the profile's co-run factor).
        workers_per_host: model workers sharing one host (the modes benchmark: 2 on 2 cores);
            the profile's ``corun_slowdown`` applies among them.
        max_num_seqs, max_num_batched_tokens, max_prefill_chunk_tokens: engine settings
            (``PD_MAX_NUM_SEQS``...); 0 chunk = whole prompts.
        local_max_tokens: the conditional router's ``PD_ROUTER_LOCAL_MAX_TOKENS``.
        heartbeat_s: the workers' heartbeat period: how stale the router's view is.
        max_queue_time_s: the gateway's admission limit (``PD_MAX_QUEUE_TIME_S``): a request
            whose predicted prefill queue — prompt tokens admitted and still before their first
            token, over the sum of the prefill workers' heartbeat rates — exceeds it is refused
            (503 ``queue_time_exceeded``; no first token, counted as not finished). 0 = no
            admission control (the decode-slot wait and the deadline rule are not modelled).
        tokenizers: tokenizer replicas.
        num_kv_blocks: KV blocks per worker (0 = the profile's).
        kv_store: the KV store kind of the hand-off (``shm``, ``redis``, ``network``; "" = the
            profile's ``kv_store``).
        kv_stage_during_prefill: ``PD_KV_STAGE_DURING_PREFILL``: a prompt prefilled in chunks
            has the full blocks of each chunk but the last put while the rest is prefilled.
        kv_prefetch: ``PD_KV_PREFETCH``: each such put is announced, and a decode worker with room
            reads the blocks it lacks into its prefix cache ahead of the DecodeTask: ``auto``
            where the decode pool is one worker, ``all`` every decode worker, ``off``.
        roles: per-role engine settings overriding the ones above: ``{"prefill": {"max_num_seqs":
            8, "max_prefill_chunk_tokens": 4096}, "decode": {...}}`` (aggregated workers take
            the ``decode`` entry's: they are the decode pool of an aggregated deployment).
    """

    mode: str = "aggregated"
    workers: int = 2
    prefill: int = 1
    decode: int = 1
    host_cores: int = 0
    workers_per_host: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_chunk_tokens: int = 0
    local_max_tokens: int = 256
    tokenizers: int = 1
    num_kv_blocks: int = 0
    enable_prefix_caching: bool = True
    heartbeat_s: float = 1.0
    max_queue_time_s: float = 0.0
    kv_store: str = ""
    kv_stage_during_prefill: bool = True
    kv_prefetch: str = "auto"
    roles: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def engine(self, role: str) -> dict:
        """The engine settings of a ``role`` worker (``prefill``, ``decode``, ``aggregated``).

        Raises:
            ValueError: a role entry naming a setting that is not one.
        """
        out = dict(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                   max_prefill_chunk_tokens=self.max_prefill_chunk_tokens)
        extra = self.roles.get("decode" if role == "aggregated" else role, {})
        unknown = set(extra) - set(out)
        if unknown:
            raise ValueError(f"roles[{role!r}]: unknown engine setting {sorted(unknown)[0]!r} ({', '.join(out)})")
        out.update(extra)
        return out

    def label(self) -> str:
        if self.mode == "aggregated":
            chunk = self.engine("aggregated")["max_prefill_chunk_tokens"]
            return f"aggregated ×{self.workers}" + (f" chunked {chunk}" if chunk else "")
        return f"{self.mode} {self.prefill}P:{self.decode}D"

    @property
    def num_workers(self) -> int:
        return self.workers if self.mode == "aggregated" else self.prefill + self.decode


#: Seconds a worker's fetch waits for a work item before it is sent again
#: (``services/common/consumer.py``: ``bus.pull(..., timeout_s=1.0)``).
FETCH_TIMEOUT_S = 1.0


class Simulation:
    """One run; use :func:`simulate`. ``seed``: the random phases of the workers' fetches and
    the step jitter's draws."""

    def __init__(self, topo: Topology, profile: Profile, max_segment: int = 4096,
                 prefill_profile: Profile | None = None, seed: int = 0):
        if topo.mode not in ("aggregated", "disaggregated", "conditional"):
            raise ValueError(f"unknown mode {topo.mode!r}")
        if prefill_profile is not None and prefill_profile.kv_bytes_per_token != profile.kv_bytes_per_token:
            raise ValueError(f"prefill profile {prefill_profile.name} holds {prefill_profile.kv_bytes_per_token} KV "
                             f"bytes per token, decode profile {profile.name} {profile.kv_bytes_per_token}: "
                             "not the same model, the KV cannot be handed over")
        self.topo, self.p, self.cost = topo, profile, CostModel(profile)
        pre_p = prefill_profile or profile
        pre_cost = CostModel(pre_p) if prefill_profile is not None else self.cost
        self.max_segment = max_segment
        self.heap: list = []
        self.n_events = 0
        self.hop = profile.bus_hop_s
        self.out_delay = 2 * profile.bus_hop_s
        self.tok_cpu = profile.token_cpu_s
        self.jitter = list(profile.step_jitter)
        self.timeline, self.bin_s = list(profile.load_timeline), profile.load_bin_s
        self.rng = random.Random(seed)
        def kw(role: str, prof: Profile) -> dict:
            return dict(num_blocks=topo.num_kv_blocks or prof.num_kv_blocks, block_size=profile.block_size,
                        enable_prefix_caching=topo.enable_prefix_caching, **topo.engine(role))

        self.hosts: list[Host] = []

        def host_for(i: int) -> Host:
            h = i // max(1, topo.workers_per_host)
            while len(self.hosts) <= h:
                self.hosts.append(Host(topo.host_cores, profile.corun_slowdown))
            return self.hosts[h]

        self.prefill: list[SimWorker] = []
        self.decode: list[SimWorker] = []
        if topo.mode == "aggregated":
            self.decode = [SimWorker(self, f"worker-{i}", "aggregated", self.cost, host_for(i),
                                     **kw("aggregated", profile)) for i in range(topo.workers)]
        else:
            # the modes benchmark's placement: prefill-i and decode-i side by side on a host
            n = max(topo.prefill, topo.decode)
            order = [(r, i) for i in range(n) for r in ("prefill", "decode")
                     if i < (topo.prefill if r == "prefill" else topo.decode)]
            for slot, (role, i) in enumerate(order):
                prof, cost = (pre_p, pre_cost) if role == "prefill" else (profile, self.cost)
                w = SimWorker(self, f"{role}-{i}", role, cost, host_for(slot), **kw(role, prof))
                (self.prefill if role == "prefill" else self.decode).append(w)
        # the KV hand-off: a FIFO server per store scope (host, fleet or worker link), and the
        # full blocks the store holds (staged once, later prompts sharing them skip the put;
        # no expiry or capacity is modelled)
        self.store = profile.store(topo.kv_store)  # the decode side's figures for the store
        self.store_free: dict = {}
        self.staged: dict[bytes, float] = {}  # block hash → when its put ends (in the store from then)
        self.kv_put_s = 0.0  # seconds the store's servers spent on puts, and on gets
        self.kv_get_s = 0.0
        self.kv_wait_s = 0.0  # seconds hand-offs waited for a busy store server
        # the router's hand-off estimates are this profile's, as the simulated hand-off is
        imp_fixed, imp_per_byte = profile.import_cost()
        per_byte_s = self.store.put_s_per_byte + self.store.get_s_per_byte + imp_per_byte
        self.router = Router(topo.local_max_tokens, profile.kv_bytes_per_token,
                             kv_bandwidth_bytes_per_s=1.0 / per_byte_s if per_byte_s > 0 else float("inf"),
                             hop_overhead_s=2 * profile.bus_hop_s + self.store.put_fixed_s + self.store.get_fixed_s
                             + imp_fixed)
        self.tok_free = [0.0] * max(1, topo.tokenizers)
        self.first: list[float] = []
        self.last: list[float] = []
        self.n_out: list[int] = []
        self.gap_v: list[float] = []
        self.gap_w: list[int] = []
        self.gap_r: list[int] = []  # the request of each gap
        self.remote = 0
        self.backlog: dict[int, list] = {}  # id(pool) → work items waiting in its stream
        self._fetch_at: dict[str, float] = {}  # worker → when its current series of fetches began
        self._full: set[str] = set()  # workers holding max_num_seqs (no fetch out)
        self._hb: dict[str, Heartbeat] = {}
        self.done = 0
        # the gateway's admission (services/gateway/tenancy/waits.py): its own backlog of prompt
        # tokens admitted and before their first token, and its predicted-wait rule
        self.admission = WaitAdmission(Settings(max_queue_time_s=topo.max_queue_time_s))
        self.refused = 0

    # --- events -----------------------------------------------------------------------
    def push(self, t: float, fn, arg) -> None:
        self.n_events += 1
        heapq.heappush(self.heap, (t, self.n_events, fn, arg))

    def run(self, requests) -> SimResult:
        n = len(requests)
        self.first = [float("nan")] * n
        self.last = [float("nan")] * n
        self.n_out = [0] * n
        self.arrival = [r.arrival_s for r in requests]
        started, cpu0 = time.perf_counter(), time.process_time()
        for r in requests:
            if self.topo.max_queue_time_s > 0:
                self.push(r.arrival_s, self._admit, r)
            else:
                self._arrive(r)
        heap = self.heap
        pop = heapq.heappop
        now = 0.0
        while heap:
            now, _, fn, arg = pop(heap)
            fn(now, arg)
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu0
        workers = self.prefill + self.decode
        util = {w.name: w.busy_s / now if now else 0.0 for w in workers}
        return SimResult(self.topo.label(), self.arrival, self.first, self.last, self.n_out, self.gap_v, self.gap_w,
                         util, now, wall, self.n_events, self.remote, self.done,
                         preemptions=sum(w.sched.num_preemptions for w in workers), cpu_s=cpu, gap_r=self.gap_r,
                         kv={"store": self.store.kind, "put_s": self.kv_put_s, "get_s": self.kv_get_s,
                             "wait_s": self.kv_wait_s,
                             "import_s": sum(w.import_s for w in self.prefill + self.decode)})

    def _admit(self, now: float, req) -> None:
        """The gateway's admission by predicted wait: :meth:`WaitAdmission.predict` over the
        workers' last heartbeats and the admitted backlog; refused when the predicted queue
        passes ``max_queue_time_s`` (``queue_time_exceeded``; the deadline rule is not
        modelled). The heartbeats carry no measured decode step, so a wait for a decode slot
        (every ``max_num_seqs`` taken) is predicted at the gateway's default step."""
        beats = {"prefill": [self._heartbeat(now, w) for w in self.prefill],
                 "decode": [self._heartbeat(now, w) for w in self.decode]}  # aggregated workers decode
        if self.admission.predict(req.prompt_tokens, 0, beats).queue_s > self.topo.max_queue_time_s:
            self.refused += 1
            return
        self.admission.admitted(str(req.idx), "", req.prompt_tokens, req.max_tokens)
        self._arrive(req)

    def _arrive(self, req) -> None:
        # the tokenizer replicas are FIFO servers; arrivals come in time order (all at once
        # before the run, or each at its time when admission is modelled), so their queue is
        # computed here. The route is decided when tokenizing ends (an event: it reads worker state).
        cost = self.cost.tokenize(req.prompt_tokens)
        i = min(range(len(self.tok_free)), key=self.tok_free.__getitem__)
        done = max(self.tok_free[i], req.arrival_s + self.hop) + cost
        self.tok_free[i] = done
        self.push(done, self._route, req)

    def _route(self, now: float, req) -> None:
        remote = self.topo.mode == "disaggregated"
        bs = self.p.block_size
        hashes = req.block_hashes(bs)
        if self.topo.mode == "conditional":
            pre = [self._heartbeat(now, w) for w in self.prefill]
            dec = [self._heartbeat(now, w) for w in self.decode]
            remote = self.router.decide(req.prompt_tokens, self._staged_prefix_tokens(now, hashes, req.prompt_tokens),
                                        pre, dec).target == "remote"
        seq = new_seq(req, bs, hashes, prefill_only=remote)
        if remote:
            self.remote += 1
        self._offer(now, self.prefill if remote else self.decode, "new", seq)

    def _offer(self, now: float, pool: list[SimWorker], kind: str, seq) -> None:
        """A work item (``new``: a prompt; ``kv``: a DecodeTask) published to ``pool``'s stream:
        a worker with room fetches it, or it waits in the stream for the first slot."""
        w = self._pull(pool, now)
        if w is None:
            self.backlog.setdefault(id(pool), []).append((kind, seq))
        else:
            self._dispatch(now, w, kind, seq)

    def _dispatch(self, now: float, w: SimWorker, kind: str, seq) -> None:
        w.pending += 1
        if self._held(w) >= w.max_num_seqs:
            self._full.add(w.name)  # its consumer stops fetching until it has room again
        if kind == "new":
            # the gateway's and tokenizer's CPU for this request, on the host it is served from
            w.host.add_cpu(now, self.p.request_cpu_s + self.cost.tokenize(seq.num_prompt_tokens))
            self.push(self._read_store_hits(now + self.hop, w, seq), self._deliver, (w, "new", seq))
        else:
            self._fetch_kv(now, w, seq)

    def room(self, now: float, w: SimWorker) -> None:
        """``w`` let go of sequences: it fetches what waits in its pool's stream, up to its room."""
        if w.name in self._full and self._held(w) < w.max_num_seqs:
            self._full.discard(w.name)
            self._fetch_at[w.name] = now  # it had no fetch out while full: it sends one now
        queue = self.backlog.get(id(self.prefill if w.role == "prefill" else self.decode))
        while queue and self._held(w) < w.max_num_seqs:
            kind, seq = queue.pop(0)
            self._fetch_at[w.name] = now
            self._dispatch(now, w, kind, seq)

    def _heartbeat(self, now: float, w: SimWorker) -> Heartbeat:
        """What the router knows of ``w``: its last heartbeat, sent every ``heartbeat_s``
        (``PD_HEARTBEAT_INTERVAL_S``; 0 = always current) — the rate its own steps showed (0
        until one has: the router's default), its queued prompt tokens, its running count."""
        last = self._hb.get(w.name)
        if last is not None and now - last.sent_at < self.topo.heartbeat_s:
            return last
        hb = Heartbeat(w.role, w.name, "", now, prefill_tokens_per_s=w.prefill_rate,
                       queued_prefill_tokens=w.queued_prefill_tokens,
                       num_running=len(w.sched.running), capacity=w.max_num_seqs)
        self._hb[w.name] = hb
        return hb

    def _pull(self, pool: list[SimWorker], now: float) -> SimWorker:
        """Which worker of ``pool`` takes the next work item: as JetStream serves the pull
        consumers (``services/common/consumer.py``) — each worker with room (fewer than
        ``max_num_seqs`` held) keeps a fetch waiting, whatever its engine is doing; a fetch
        returns with the first item it gets and the worker fetches again at once, and a fetch
        that got nothing expires after :data:`FETCH_TIMEOUT_S` and is sent again. The server
        serves the waiting fetches oldest first, so the item goes to the worker whose current
        fetch was sent earliest: usually not the one that took the last item, but whichever
        worker's fetch expired least recently (the phases start at random: ``seed``). With no
        room anywhere, None (the item waits in the stream for the first slot: :meth:`room`).

        Not modelled: a fetch of ``n`` > 1 leaves its pull request open on the server for the
        rest of its ``n`` after returning, so a worker that just took an item sometimes takes
        the next one too (two nats-py consumers, an item every 0.15 s: fetches of 16 went
        ``A B B A B A B B A B B A B B A B``, fetches of 1 in strict turns)."""
        best, best_t = None, 0.0
        for w in pool:
            if self._held(w) >= w.max_num_seqs:
                continue
            base = self._fetch_at.setdefault(w.name, -self.rng.random() * FETCH_TIMEOUT_S)
            sent = base + FETCH_TIMEOUT_S * ((now - base) // FETCH_TIMEOUT_S)
            if best is None or sent < best_t:
                best, best_t = w, sent
        if best is not None:
            self._fetch_at[best.name] = now
        return best

    @staticmethod
    def _held(w: SimWorker) -> int:
        """Sequences ``w`` holds or has fetched (what its consumer counts against max_num_seqs)."""
        return w.sched.num_unfinished + len(w.inbox) + w.pending

    def _deliver(self, now: float, arg) -> None:
        w, kind, seq = arg
        w.pending -= 1
        w.deliver(now, kind, seq)

    def _store_job(self, now: float, key, seconds: float) -> float:
        """Queue a job of ``seconds`` on the store server ``key`` at ``now``; when it ends."""
        start = max(now, self.store_free.get(key, 0.0))
        self.kv_wait_s += start - now
        self.store_free[key] = end = start + seconds
        return end

    def _server(self, w: SimWorker):
        scope = self.store.scope
        return id(w.host) if scope == "host" else "fleet" if scope == "fleet" else w.name

    def stage_blocks(self, now: float, seq, src: SimWorker) -> None:
        """A chunk of ``seq``'s prompt ended at ``now`` on prefill worker ``src`` and the prompt
        is not done (``kv_stage_during_prefill``): its staging thread puts the full blocks the
        store lacks, a job on the store's server that the hand-off's put queues behind."""
        bs, bpt = self.p.block_size, self.p.kv_bytes_per_token
        new = [h for h in seq.block_hashes[: seq.num_computed_tokens // bs] if h not in self.staged]
        if not new:
            return
        seconds = self.store.put(len(new) * bs * bpt)
        self.kv_put_s += seconds
        end = self._store_job(now, self._server(src), seconds)
        self.staged.update(dict.fromkeys(new, end))
        prefetch = self.topo.kv_prefetch
        if prefetch == "all" or prefetch == "auto" and len(self.decode) == 1:
            self.push(end + self.hop, self._prefetch, tuple(seq.block_hashes[: seq.num_computed_tokens // bs]))

    def _prefetch(self, now: float, hashes: tuple) -> None:
        """A KVPrefetch naming a prompt's leading blocks ``hashes`` reached the decode pool
        (``PD_KV_PREFETCH``): every decode worker with room (the test of ``DecodeWorker._capacity``,
        as :meth:`_pull` counts it) reads the run it lacks and the store holds (a job on its
        get server, as a hand-off's read); the engine imports them at its next step boundary
        (:meth:`SimWorker.prefetched`). Not modelled: a DecodeTask fetched while that read runs
        waits for it in pdserve; here it reads the blocks again."""
        bs, bpt = self.p.block_size, self.p.kv_bytes_per_token
        for w in self.decode:
            if self._held(w) >= w.max_num_seqs or not w.bm.enable_prefix_caching:
                continue
            local = leading_hits(w.bm, hashes)
            run = self._staged_run(now, hashes[local:])
            if run == 0:
                continue
            seconds = self.store.get(run * bs * bpt)
            self.kv_get_s += seconds
            end = self._store_job(now, ("get", self._server(w)), seconds)
            self.push(end, self._prefetched, (w, hashes[:local], hashes[local:local + run]))

    def _prefetched(self, now: float, arg) -> None:
        w, keep, blocks = arg
        w.prefetched(now, keep, blocks)

    def _staged_prefix_tokens(self, now: float, hashes: list[bytes], num_tokens: int) -> int:
        """The tokenizer's ``_staged_prefix_tokens``: leading prompt tokens whose blocks the
        store holds (the conditional router's ``num_cached_tokens``)."""
        usable = hashes[: num_reusable_blocks(num_tokens, self.p.block_size)]
        return self._staged_run(now, usable) * self.p.block_size

    def _staged_run(self, now: float, hashes) -> int:
        """How many of ``hashes``' leading blocks are in the store at ``now``: ``exists`` sees a
        block once its put has ended."""
        inf = float("inf")
        return next((i for i, h in enumerate(hashes) if self.staged.get(h, inf) > now), len(hashes))

    def _read_store_hits(self, now: float, w: SimWorker, seq) -> float:
        """Worker ``w`` took new prompt ``seq`` at ``now``: as ``ModelWorker.import_store_hits``,
        its thread reads the leading run of reusable blocks that its prefix cache lacks and the
        store holds (a job on the store's server; the engine imports them when it admits the
        prompt). Returns when the prompt reaches the engine."""
        if not self.staged or not w.bm.enable_prefix_caching:
            return now
        bs = self.p.block_size
        usable = seq.block_hashes[: num_reusable_blocks(seq.num_prompt_tokens, bs)]
        wanted = usable[leading_hits(w.bm, usable):]
        run = self._staged_run(now, wanted)
        if run == 0:
            return now
        seq.store_hits, seq.kv_bytes = tuple(wanted[:run]), run * bs * self.p.kv_bytes_per_token
        seconds = self.store.get(seq.kv_bytes)
        self.kv_get_s += seconds
        return self._store_job(now, ("get", self._server(w)), seconds)

    def hand_off(self, now: float, seq, src: SimWorker) -> None:
        """Prefill worker ``src`` computed ``seq``'s prompt at ``now``: its staging thread puts
        the full blocks the store lacks (those of earlier chunks are there already with
        ``kv_stage_during_prefill``) and the tail (a job on the store's server); the
        DecodeTask reaches the decode pool a hop after the put ends."""
        seq.stop_after_prefill = False
        bs, bpt = self.p.block_size, self.p.kv_bytes_per_token
        full = seq.num_prompt_tokens // bs
        new = [h for h in seq.block_hashes[:full] if h not in self.staged]
        seconds = self.store.put((len(new) * bs + seq.num_prompt_tokens % bs) * bpt)
        self.kv_put_s += seconds
        end = self._store_job(now, self._server(src), seconds)
        self.staged.update(dict.fromkeys(new, end))
        self.push(end + self.hop, self._kv_task, seq)

    def _kv_task(self, now: float, seq) -> None:
        """``seq``'s DecodeTask is published to the decode pool."""
        self._offer(now, self.decode, "kv", seq)

    def _fetch_kv(self, now: float, w: SimWorker, seq) -> None:
        """Decode worker ``w`` fetched ``seq``'s DecodeTask: its thread reads the full blocks
        its prefix cache lacks and the tail from the store; the engine imports them after."""
        bs, bpt = self.p.block_size, self.p.kv_bytes_per_token
        full = seq.num_prompt_tokens // bs
        local = leading_hits(w.bm, seq.block_hashes[:full]) if w.bm.enable_prefix_caching else 0
        seq.kv_bytes = ((full - local) * bs + seq.num_prompt_tokens % bs) * bpt
        seconds = self.store.get(seq.kv_bytes)
        self.kv_get_s += seconds
        self.push(self._store_job(now, ("get", self._server(w)), seconds), self._deliver, (w, "kv", seq))

    def host_changed(self, now: float, worker: SimWorker) -> None:
        """A worker went busy or idle: the others of its host re-time from their next step."""
        if len(worker.host.workers) > 1:
            for w in worker.host.workers:
                if w is not worker and w.busy:
                    w.cut(now)

    # --- outputs ----------------------------------------------------------------------
    def load_factor(self, now: float) -> float:
        """The profile's ``load_timeline`` at ``now`` (1.0 without)."""
        if not self.timeline or self.bin_s <= 0:
            return 1.0
        return self.timeline[min(int(now / self.bin_s), len(self.timeline) - 1)]

    def jitter_factor(self) -> float:
        """One step's draw of the profile's ``step_jitter`` (1.0 without)."""
        return self.jitter[self.rng.randrange(len(self.jitter))] if self.jitter else 1.0

    def tokens(self, seq, first_end: float, end: float, k: int, host: Host, step_s: float = 0.0) -> None:
        """``seq`` sampled ``k`` tokens, the first at ``first_end``, the last at ``end``; a
        segment's steps take ``step_s`` (its first) and more. With ``step_jitter`` a segment's
        gaps are spread over its factors (each gap once per factor, weight 1/len): the segment's
        length is that of its mean step, its gaps are distributed as jittered steps would be."""
        i = seq.req.idx
        jit = self.jitter if k > 1 else ()
        if seq.last_t < 0:
            self.first[i] = first_end + self.out_delay + self.tok_cpu + self.p.pipeline_s
            if self.admission.backlog.prefilled(str(i)) is not None:
                # the gateway learns the computed share from usage at the request's end; here at
                # its first token (the hits are known by then)
                self.admission.learn_cached(seq.num_prompt_tokens, seq.num_cached_tokens)
        elif jit:
            wait, w = first_end - seq.last_t - step_s, 1 / len(jit)
            for j in jit:
                self.gap_v.append(wait + step_s * j)
                self.gap_w.append(w)
                self.gap_r.append(i)
        else:
            self.gap_v.append(first_end - seq.last_t)
            self.gap_w.append(1)
            self.gap_r.append(i)
        if k > 1:
            g = (end - first_end) / (k - 1)
            if jit:
                w = (k - 1) / len(jit)
                for j in jit:
                    self.gap_v.append(g * j)
                    self.gap_w.append(w)
                    self.gap_r.append(i)
            else:
                self.gap_v.append(g)
                self.gap_w.append(k - 1)
                self.gap_r.append(i)
        seq.last_t = end
        self.n_out[i] += k
        self.last[i] = end + self.out_delay + self.tok_cpu + self.p.pipeline_s
        host.add_cpu(end, self.tok_cpu * k)

    def finished(self, seq, now: float) -> None:
        self.done += 1
        self.admission.finished(str(seq.req.idx))  # its reserved output tokens leave the gateway's count


def simulate(requests, topo: Topology, profile: Profile, slo_ttft_s: float = 5.0, slo_tpot_s: float = 0.25,
             max_segment: int = 4096, keep: list[bool] | None = None, prefill_profile: Profile | None = None,
             seed: int = 0) -> dict:
    """Replay ``requests`` (:class:`~sim.trace.SimRequest`, arrival order) through
    ``topo`` with ``profile``'s costs (the prefill pool's from ``prefill_profile`` when given:
    heterogeneous pools); returns :func:`sim.metrics.summarize`'s dict,
    over the requests ``i`` with ``keep[i]`` only when ``keep`` is given (all are simulated).

    Raises:
        ValueError: an unknown mode, a store kind the profile has no figures for, pools of
            different models.
    """
    result = Simulation(topo, profile, max_segment, prefill_profile, seed).run(requests)
    return summarize(result.only(keep) if keep is not None else result, slo_ttft_s, slo_tpot_s)
