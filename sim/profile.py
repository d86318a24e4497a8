"""The cost profile the simulator runs on: what one engine step, one KV hand-off, one bus hop
and the per-token pipeline work cost on one machine and model, in seconds.

A profile is a JSON file (``version`` :data:`VERSION`) written by ``pdserve profile``
(:mod:`sim.measure`, measured with the engine's own code paths) or by hand from
published figures (``docs/profiles/``; every such number carries its source in ``sources``).

Step-time model (the shape Vidur and Dynamo's SLA planner interpolate, Agrawal et al. 2024;
NVIDIA Dynamo ``docs/architecture/sla_planner.md``):

* prefill chunk of ``n`` tokens after ``c`` already computed ones:
  ``prefill(n) + prefill_ctx_attn_s * n * c`` — ``prefill(n)`` interpolated (piecewise linear) in
  the measured ``prefill_tokens``/``prefill_s`` table at empty context. The context term has
  its own coefficient because an engine may compute it on another path than a fresh prompt's
  self-attention (pdserve's batch-invariant CPU mode: a fresh prompt's attention is tiled, a
  chunk's attention to cached blocks runs the tiled paged kernel — on the AVX2 EPYC the
  profile measured 3.0e-6 s per pair, where its in-prompt estimate was 0,
  ``docs/data/sim-oos-avx2/profile.json``); a profile without it uses ``prefill_attn_s``;
* decode step of ``B`` sequences holding ``C`` context tokens in all:
  ``decode(B) + decode_ctx_s * C`` — ``decode(B)`` interpolated in ``decode_batch``/``decode_s``;
* several prompts' chunks in one step: one forward over their ``N = Σ n`` tokens,
  ``prefill(N)`` less the self-attention between different chunks the table's ``N``-token
  prompt had (``prefill_attn_s · (N² − Σ n²) / 2``), plus each chunk's attention to its own
  context (the engine batches the chunks into one model call; their cost is not a sum of
  one-prompt steps);
* a mixed step (chunked prefill beside decodes): ``prefill(...) + decode(B) − step_fixed_s``
  (the fixed per-step cost — weights read once, Python overhead — is paid once).

KV hand-off model (what ``services/prefill/worker.py`` and ``services/decode/worker.py`` do):

* the prefill worker stages a prompt's KV **in a thread** (``asyncio.to_thread(KVStager.stage)``):
  its engine goes on stepping; the put is a job on the store's FIFO server (:class:`StoreCost`),
  writing only the full blocks the store does not hold yet, plus the prompt's tail;
* the decode worker reads the blocks it lacks **in a thread** (``_load_kv``), again a job on
  the store's server;
* the decode worker imports them into its pool (``admit_with_kv``) **on the engine thread**:
  ``kv_import_fixed_s + kv_import_s_per_byte · bytes`` delays that worker's next step.

The interpolations are tabulated once per integer argument (:meth:`CostModel.decode_step`
is a list lookup), since the simulator asks for them millions of times.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

VERSION = 1

#: The KV store kinds a deployment can use (``PD_KV_STORE``; ``network`` is a point-to-point
#: transfer over the workers' links, as NIXL or Mooncake's transfer engine do, which the cited
#: GPU profiles assume; pdserve itself has ``shm`` and ``redis``).
STORE_KINDS = ("shm", "redis", "network")
#: Which FIFO servers a store kind has: one per host (``shm``: the host's memory copy), one for
#: the fleet (``redis``: one single-threaded server), one per worker link (``network``: a put is
#: queued on the sending worker's link, a get on the receiving worker's).
STORE_SCOPES = {"shm": "host", "redis": "fleet", "network": "worker"}


@dataclass(frozen=True)
class StoreCost:
    """One KV store kind's service times (seconds; a FIFO server per :data:`STORE_SCOPES`).

    A put of ``b`` bytes holds its server ``put_fixed_s + put_s_per_byte · b``; a get likewise.
    ``source`` says where the figures come from.
    """

    kind: str
    put_fixed_s: float
    put_s_per_byte: float
    get_fixed_s: float
    get_s_per_byte: float
    source: str = ""

    @property
    def scope(self) -> str:
        return STORE_SCOPES[self.kind]

    def put(self, num_bytes: float) -> float:
        return self.put_fixed_s + self.put_s_per_byte * num_bytes

    def get(self, num_bytes: float) -> float:
        return self.get_fixed_s + self.get_s_per_byte * num_bytes



def monotone(ys: list[float]) -> list[float]:
    """Running maximum of a cost table: a step never gets cheaper with more tokens or sequences
    (removes noise dips from measured or calibrated tables)."""
    out, m = [], 0.0
    for y in ys:
        m = max(m, y)
        out.append(m)
    return out

def smooth_prefill(tokens: list[int], seconds: list[float]) -> list[float]:
    """A measured prefill table (``seconds[i]`` for a prompt of ``tokens[i]`` tokens) replaced by
    its least-squares fit ``a + b n + c n²`` (``a, b, c >= 0``; errors weighted relative, so
    the short prompts count as much as the long), evaluated at the same points.

    The form is DistServe's prefill latency model (Zhong et al., OSDI 2024, §4.2: a constant,
    a term linear in the prompt's tokens for the linear layers, a quadratic one for attention
    over itself). A table point measured in 2 repeats can be off by a quarter on a shared VM
    (a quick profile put 6.3 ms per token at 128 tokens between 4.6 at 64 and 5.4 at 256), and
    every chunk of that size inherits the error; the fit spreads it over the table. Tables of
    fewer than four points are returned as they are.

    Raises:
        ValueError: ``tokens`` and ``seconds`` differ in length.
    """
    if len(tokens) != len(seconds):
        raise ValueError(f"{len(tokens)} table points against {len(seconds)} times")
    if len(tokens) < 4 or min(seconds) <= 0:
        return list(seconds)
    n = np.asarray(tokens, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    basis = np.stack([np.ones_like(n), n, n * n], axis=1) / t[:, None]
    best = None
    # the non-negative least squares over three terms: every subset of active terms, the
    # best feasible one (no solver needed for three columns)
    for mask in ((1, 1, 1), (1, 1, 0), (0, 1, 1), (1, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 1)):
        cols = [i for i in range(3) if mask[i]]
        coef, *_ = np.linalg.lstsq(basis[:, cols], np.ones_like(t), rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[cols] = coef
        err = float(((basis @ full - 1.0) ** 2).sum())
        if best is None or err < best[0]:
            best = (err, full)
    a, b, c = best[1]
    return [float(a + b * x + c * x * x) for x in tokens]


@dataclass
class Profile:
    """Measured (or cited) costs of one worker class. Times in seconds, sizes in bytes/tokens.

    Attributes:
        name: short label (``this-machine-smollm2``, ``a100-llama13b``...).
        measured: True when ``pdserve profile`` measured it; False for a cited profile.
        machine, model, dtype: what it describes.
        prefill_tokens, prefill_s: prefill step time by chunk tokens (empty context), ascending.
        prefill_attn_s: seconds per pair of tokens attending to each other inside one prompt
            (the table's ``n``-token prompt holds ``n²/2``; steps of several chunks subtract the
            pairs between different chunks).
        prefill_ctx_attn_s: extra seconds per (chunk token × context token computed before the
            chunk: a chunked prompt's later chunks, the new tokens after a prefix-cache hit);
            None = ``prefill_attn_s``.
        decode_batch, decode_s: decode step time by batch size (short contexts), ascending.
        decode_ctx_s: extra decode step seconds per context token held by the batch.
        step_fixed_s: per-step cost independent of tokens (paid once by a mixed step).
        kv_bytes_per_token: KV bytes of one token (all layers, K and V).
        kv_stage_fixed_s, kv_stage_s_per_byte: staging a prompt's KV into the store (prefill side).
        kv_load_fixed_s, kv_load_s_per_byte: loading it into the decode worker's pool.
        bus_hop_s: one JetStream work-queue hop (publish → a consumer has it).
        tokenize_s, tokenize_s_per_token: the tokenizer worker's service time per request.
        token_cpu_s: host CPU per streamed token outside the model workers (postfilter
            detokenize, bus, gateway SSE, client).
        request_cpu_s: host CPU per request outside the model workers (gateway, tokenizer, bus).
        step_loop_s: the worker loop's own time per step beyond ``LLMEngine.step`` (publishing
            tokens, the thread hop, heartbeats); calibrated from an idle request's ITL.
        pipeline_s: latency a request's first token spends in processes and hops beyond the
            modelled ones; calibrated from an idle request's TTFT.
        corun_slowdown: step-time factor when another model worker on the same host is busy
            (shared memory bandwidth and caches), 1.0 = none.
        step_jitter: equally likely factors (mean 1) one step's time is multiplied by — the
            spread of observed over predicted step times of a run on a shared machine (other
            processes taking the core for a while), measured by :mod:`sim.calibrate`;
            empty = steps take exactly their predicted time.
        load_timeline, load_bin_s: step-time factor per ``load_bin_s`` seconds from the
            simulation's start (last one held after): a measured run's machine speed over time
            (:mod:`sim.calibrate`), replayed to validate against that run; empty = 1.
        host_cores: cores of the host the profile was measured on.
        num_kv_blocks, block_size: one worker's KV pool.
        kv_store: the store kind a deployment uses unless its topology names another.
        kv_stores: store kind → its :class:`StoreCost` fields (``put_fixed_s``, ``put_s_per_byte``,
            ``get_fixed_s``, ``get_s_per_byte``, ``source``); a profile without an entry for
            ``kv_store`` has it built from ``kv_stage_*`` (the put) with a free get.
        kv_import_fixed_s, kv_import_s_per_byte: the decode engine thread's cost to place loaded
            KV in its pool (``admit_with_kv``); None = ``kv_load_*`` (which a measured profile
            times together with the store's get, so charging it all here is the cautious side).
        tp_options: tensor-parallel degree → the name of the profile of that many GPUs per
            worker (for the planner's TP search), where such profiles exist.
        sources: where each cited number comes from (cited profiles), or how it was measured.
    """

    name: str
    measured: bool
    machine: str
    model: str
    dtype: str
    prefill_tokens: list[int]
    prefill_s: list[float]
    decode_batch: list[int]
    decode_s: list[float]
    prefill_attn_s: float = 0.0
    prefill_ctx_attn_s: float | None = None
    decode_ctx_s: float = 0.0
    step_fixed_s: float = 0.0
    kv_bytes_per_token: int = 0
    kv_stage_fixed_s: float = 0.0
    kv_stage_s_per_byte: float = 0.0
    kv_load_fixed_s: float = 0.0
    kv_load_s_per_byte: float = 0.0
    bus_hop_s: float = 0.001
    tokenize_s: float = 0.0
    tokenize_s_per_token: float = 0.0
    token_cpu_s: float = 0.0
    request_cpu_s: float = 0.0
    step_loop_s: float = 0.0
    pipeline_s: float = 0.0
    corun_slowdown: float = 1.0
    step_jitter: list[float] = field(default_factory=list)
    load_timeline: list[float] = field(default_factory=list)
    load_bin_s: float = 0.0
    host_cores: int = 0
    num_kv_blocks: int = 4096
    block_size: int = 16
    kv_store: str = "shm"
    kv_stores: dict = field(default_factory=dict)
    kv_import_fixed_s: float | None = None
    kv_import_s_per_byte: float | None = None
    sources: dict = field(default_factory=dict)
    version: int = VERSION

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile file.

        Raises:
            ValueError: a version this code does not read, or missing fields.
        """
        data = json.loads(Path(path).read_text())
        if data.get("version") != VERSION:
            raise ValueError(f"{path}: profile version {data.get('version')}, this code reads {VERSION}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def store(self, kind: str = "") -> StoreCost:
        """The :class:`StoreCost` of store ``kind`` (default: the profile's ``kv_store``).

        Raises:
            ValueError: an unknown kind, or one this profile has no figures for.
        """
        kind = kind or self.kv_store
        if kind not in STORE_KINDS:
            raise ValueError(f"unknown KV store {kind!r} ({', '.join(STORE_KINDS)})")
        if kind in self.kv_stores:
            return StoreCost(kind=kind, **self.kv_stores[kind])
        if kind == self.kv_store:
            return StoreCost(kind, self.kv_stage_fixed_s, self.kv_stage_s_per_byte, 0.0, 0.0,
                             "kv_stage_* (the put); the get is inside kv_load_*")
        raise ValueError(f"profile {self.name} has no figures for the {kind} KV store "
                         f"(it has {', '.join(sorted({self.kv_store, *self.kv_stores}))})")

    @property
    def ctx_attn_s(self) -> float:
        """Seconds per (chunk token × earlier context token): ``prefill_ctx_attn_s``, or
        ``prefill_attn_s`` where the profile has no separate context term."""
        return self.prefill_attn_s if self.prefill_ctx_attn_s is None else self.prefill_ctx_attn_s

    def import_cost(self) -> tuple[float, float]:
        """(fixed seconds, seconds per byte) of the decode engine thread's KV import."""
        fixed = self.kv_load_fixed_s if self.kv_import_fixed_s is None else self.kv_import_fixed_s
        per_byte = self.kv_load_s_per_byte if self.kv_import_s_per_byte is None else self.kv_import_s_per_byte
        return fixed, per_byte

    def digest(self) -> str:
        """A hash of everything the simulator reads (sweep results are stamped with it)."""
        import hashlib

        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def scaled(self, compute: float = 1.0, host: float = 1.0) -> Profile:
        """A copy with step times × ``compute`` and host-side CPU costs × ``host`` (a machine
        under another load; used to correct a profile by a fresh measurement)."""
        d = asdict(self)
        d["prefill_s"] = [x * compute for x in self.prefill_s]
        d["decode_s"] = [x * compute for x in self.decode_s]
        for k in ("prefill_attn_s", "decode_ctx_s", "step_fixed_s"):
            d[k] = d[k] * compute
        if d["prefill_ctx_attn_s"] is not None:
            d["prefill_ctx_attn_s"] *= compute
        for k in ("tokenize_s", "tokenize_s_per_token", "token_cpu_s", "request_cpu_s", "kv_stage_fixed_s",
                  "kv_stage_s_per_byte", "kv_load_fixed_s", "kv_load_s_per_byte"):
            d[k] = d[k] * host
        for k in ("kv_import_fixed_s", "kv_import_s_per_byte"):
            d[k] = None if d[k] is None else d[k] * host
        d["kv_stores"] = {kind: {f: (v * host if isinstance(v, float) else v) for f, v in fields.items()}
                          for kind, fields in self.kv_stores.items()}
        return Profile(**d)


class CostModel:
    """The profile's cost functions, tabulated for integer arguments.

    Args:
        profile: the costs.
        max_tokens: largest chunk (tokens) tabulated; larger ones extrapolate linearly.
        max_batch: largest decode batch tabulated.
    """

    def __init__(self, profile: Profile, max_tokens: int = 8192, max_batch: int = 1024):
        max_tokens = max(max_tokens, profile.prefill_tokens[-1])  # a long-context table is tabulated whole
        self.p = profile
        xs = np.arange(max_tokens + 1)
        self._prefill = _interp(xs, profile.prefill_tokens, profile.prefill_s).tolist()
        self._prefill[0] = 0.0
        bs = np.arange(max_batch + 1)
        self._decode = _interp(bs, profile.decode_batch, profile.decode_s).tolist()
        self._decode[0] = 0.0
        self.max_tokens, self.max_batch = max_tokens, max_batch
        self.attn = profile.prefill_attn_s
        self.ctx_attn = profile.ctx_attn_s
        self.ctx = profile.decode_ctx_s
        self.fixed = profile.step_fixed_s
        self.kv_bpt = profile.kv_bytes_per_token
        self.loop = profile.step_loop_s

    def prefill(self, n: int) -> float:
        """Seconds of a prefill chunk of ``n`` tokens at empty context."""
        if n <= self.max_tokens:
            return self._prefill[n]
        return self._prefill[self.max_tokens] * n / self.max_tokens

    def prefill_whole(self, n: int) -> float:
        """Seconds to prefill an ``n``-token prompt in one step, attention over itself included.

        The table's ``prefill(n)`` holds the prompt's ``n²/2`` attention pairs already (it was
        measured on whole prompts); past its last point ``L`` it is extrapolated linearly, which
        misses ``(n - L)²/2`` of the pairs (the quadratic term's growth beyond the tangent at
        ``L``): those are added at ``prefill_attn_s``."""
        beyond = max(0, n - self.p.prefill_tokens[-1]) if self.p.prefill_tokens else 0
        return self.prefill(n) + self.attn * beyond * beyond / 2

    def decode_step(self, batch: int, context_tokens: int) -> float:
        """Seconds of a decode step of ``batch`` sequences holding ``context_tokens`` in all."""
        base = self._decode[batch] if batch <= self.max_batch else self._decode[self.max_batch] * batch / self.max_batch
        return base + self.ctx * context_tokens

    def step(self, prefill_chunks: list[tuple[int, int]], batch: int, context_tokens: int) -> float:
        """Seconds of one step: ``prefill_chunks`` as (new tokens, computed before) pairs, beside
        ``batch`` decoding sequences holding ``context_tokens``."""
        t = self.loop
        if len(prefill_chunks) == 1:
            n, c = prefill_chunks[0]
            t += self.prefill(n) + self.ctx_attn * n * c
        elif prefill_chunks:
            # one forward over all chunks: the linear layers see their total, attention is per
            # sequence (the table's prefill(N) holds N²/2 pairs of self-attention; the chunks
            # have Σ n²/2 among themselves and n·c with their contexts)
            total = sum(n for n, _ in prefill_chunks)
            cross = self.attn * (total * total - sum(n * n for n, _ in prefill_chunks)) / 2
            # never below the largest chunk alone (a profile whose attention term outgrows its table)
            t += max(self.prefill(total) - cross, max(self.prefill(n) for n, _ in prefill_chunks))
            t += self.ctx_attn * sum(n * c for n, c in prefill_chunks)
        if prefill_chunks:
            if batch:
                # never below the decode step alone: the chunk's tokens only add work
                decode = self.decode_step(batch, context_tokens)
                t = max(t + decode - self.fixed, self.loop + decode)
            return t
        return t + self.decode_step(batch, context_tokens)

    def kv_stage(self, num_tokens: int) -> float:
        return self.p.kv_stage_fixed_s + self.p.kv_stage_s_per_byte * num_tokens * self.kv_bpt

    def kv_load(self, num_tokens: int) -> float:
        return self.p.kv_load_fixed_s + self.p.kv_load_s_per_byte * num_tokens * self.kv_bpt

    def kv_import(self, num_bytes: float) -> float:
        """Engine-thread seconds to import ``num_bytes`` of loaded KV (0 bytes: nothing to do)."""
        if num_bytes <= 0:
            return 0.0
        fixed, per_byte = self.p.import_cost()
        return fixed + per_byte * num_bytes

    def tokenize(self, num_tokens: int) -> float:
        return self.p.tokenize_s + self.p.tokenize_s_per_token * num_tokens

    def prefill_rate(self) -> float:
        """Tokens/s of a 512-token prefill (what the router's heartbeats report)."""
        return 512 / max(self.prefill(512), 1e-9)


def _interp(x: np.ndarray, xp: list, fp: list) -> np.ndarray:
    """Piecewise linear in the table, linear extrapolation past its last two points."""
    xp_a, fp_a = np.asarray(xp, float), np.asarray(fp, float)
    y = np.interp(x, xp_a, fp_a)
    if len(xp_a) >= 2:
        slope = (fp_a[-1] - fp_a[-2]) / max(xp_a[-1] - xp_a[-2], 1e-9)
        hi = x > xp_a[-1]
        y[hi] = fp_a[-1] + slope * (x[hi] - xp_a[-1])
        lo_slope = (fp_a[1] - fp_a[0]) / max(xp_a[1] - xp_a[0], 1e-9)
        lo = x < xp_a[0]
        y[lo] = np.maximum(fp_a[0] - lo_slope * (xp_a[0] - x[lo]), fp_a[0] * 0.5)
    return y
