"""Requests for the simulator: arrival time, prompt length, output length and the prompt's
block hashes (so prefix caching meets the trace's real sharing), read straight from the trace
files without building token lists (a 100k-request trace loads in about a second).

Sources: the Azure LLM inference traces 2023 and the Mooncake traces, as in
:mod:`loadtest.workloads`, which reuses this module's trace reading and ``Scaling``, so a simulated
replay states the same fitting as a measured one; synthetic Poisson/gamma mixes as in
:func:`loadtest.workloads.synthetic`.
"""

from __future__ import annotations

import csv
import json
import random
import struct
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

#: Token ids drawn for synthetic prompts stay inside this range (clear of special tokens),
#: narrowed for a smaller vocabulary.
TOKEN_LOW, TOKEN_HIGH = 1000, 40000


def token_range(vocab_size: int | None) -> tuple[int, int]:
    """The ``[low, high)`` token ids synthetic prompts draw from for a vocabulary of ``vocab_size``."""
    if not vocab_size or vocab_size >= TOKEN_HIGH:
        return TOKEN_LOW, TOKEN_HIGH
    return min(TOKEN_LOW, vocab_size // 4), vocab_size


#: The full public traces (the ``shared/traces`` folder beside the checkout), then the samples shipped here.
TRACES_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
SAMPLES_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class Scaling:
    """How a trace was fitted to this machine; printed in every report."""

    time_scale: float
    max_prompt_tokens: int
    max_output_tokens: int
    block_tokens: int = 0
    note: str = ""

    def describe(self) -> str:
        s = (f"inter-arrival gaps × {self.time_scale:g}, prompts capped at {self.max_prompt_tokens} tokens, "
             f"outputs at {self.max_output_tokens}")
        if self.block_tokens:
            s += f", Mooncake 512-token blocks scaled to {self.block_tokens} tokens"
        return s + (f"; {self.note}" if self.note else "")


def random_tokens(rng: random.Random, n: int, vocab_size: int | None = None) -> list[int]:
    """``n`` token ids drawn from ``rng`` inside :func:`token_range`."""
    low, high = token_range(vocab_size)
    return [rng.randrange(low, high) for _ in range(n)]


def trace_path(name: str) -> Path:
    """A trace file from ``../shared/traces`` (the full public traces) or the bundled samples."""
    for folder in (TRACES_DIR, SAMPLES_DIR):
        path = folder / name
        if path.exists():
            return path
    raise FileNotFoundError(f"trace {name} is in neither {TRACES_DIR} nor {SAMPLES_DIR}")


def timestamp_s(text: str) -> float:
    """An Azure trace timestamp (``"2023-11-16 18:17:03.9799600"``: seven fractional digits) in unix seconds."""
    head, _, frac = text.partition(".")
    return datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp() + float("0." + (frac or "0"))


@dataclass(slots=True)
class SimRequest:
    """One simulated request. ``hash_ids``: ids of the prompt's shared segments (Mooncake),
    each ``segment_tokens`` long; None = a prompt shared with no one."""

    idx: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    hash_ids: tuple[int, ...] | None = None
    segment_tokens: int = 0

    def block_hashes(self, block_size: int) -> list[bytes]:
        """Hashes of the prompt's full blocks: equal for equal prefixes, like
        :func:`shared.hashing.block_hashes` on real tokens, but built without the tokens."""
        n = self.prompt_tokens // block_size
        if self.hash_ids is None:
            head = struct.pack("<q", -1 - self.idx)
            return [head + struct.pack("<I", j) for j in range(n)]
        out = []
        for j in range(n):
            seg = min(j * block_size // self.segment_tokens, len(self.hash_ids) - 1)
            out.append(struct.pack("<qI", self.hash_ids[seg], j))
        return out


def azure(name: str, n: int, scaling: Scaling, start: int = 0) -> list[SimRequest]:
    """``n`` requests of an Azure 2023 trace (``azure2023_conv.csv``, ``azure2023_code.csv``)."""
    out: list[SimRequest] = []
    t0 = None
    with open(trace_path(name)) as fh:
        for i, row in enumerate(csv.DictReader(fh)):
            if i < start:
                continue
            if len(out) == n:
                break
            t = timestamp_s(row["TIMESTAMP"])
            t0 = t if t0 is None else t0
            out.append(SimRequest(len(out), (t - t0) * scaling.time_scale,
                                  max(1, min(int(row["ContextTokens"]), scaling.max_prompt_tokens)),
                                  max(1, min(int(row["GeneratedTokens"]), scaling.max_output_tokens))))
    return out


def mooncake(name: str, n: int, scaling: Scaling) -> list[SimRequest]:
    """``n`` requests of a Mooncake trace; its 512-token blocks become ``scaling.block_tokens``."""
    seg = scaling.block_tokens or 64
    out: list[SimRequest] = []
    with open(trace_path(name)) as fh:
        for line in fh:
            if len(out) == n:
                break
            rec = json.loads(line)
            ids = tuple(rec["hash_ids"])
            length = min(max(1, rec["input_length"] * seg // 512), scaling.max_prompt_tokens, len(ids) * seg)
            out.append(SimRequest(len(out), rec["timestamp"] / 1000.0 * scaling.time_scale, length,
                                  max(1, min(rec["output_length"], scaling.max_output_tokens)), ids, seg))
    return out


def synthetic(n: int, rate_per_s: float, prompt_lengths: list[tuple[int, float]], output_tokens: int,
              burstiness: float = 1.0, seed: int = 0, vocab_size: int | None = None) -> list[SimRequest]:
    """The arrivals and lengths of :func:`loadtest.workloads.synthetic` with the same seed
    (the same random draws in the same order, so a simulation replays the measured workload)."""
    rng = random.Random(seed)
    lengths, weights = zip(*prompt_lengths)
    t, shape = 0.0, 1.0 / burstiness
    out = []
    for i in range(n):
        length = rng.choices(lengths, weights)[0]
        random_tokens(rng, length, vocab_size)  # keep the draws in step with the measured workload's
        out.append(SimRequest(i, t, length, output_tokens))
        t += rng.gammavariate(shape, 1.0 / (rate_per_s * shape))
    return out


def shared_prefix(n: int, rate_per_s: float, groups: int = 4, system_tokens: int = 512,
                  question_tokens: tuple[int, int] = (32, 160), long_tokens: int = 1536, long_share: float = 0.2,
                  output_tokens: int = 48, seed: int = 0, segment_tokens: int = 32) -> list[SimRequest]:
    """Poisson arrivals of two kinds of prompt: with probability ``1 - long_share`` one of
    ``groups`` shared system prompts (``system_tokens``) followed by a question of its own
    (``question_tokens``, uniform), else a ``long_tokens`` prompt shared with no one (a pasted
    document). Every prompt is named by hash ids of ``segment_tokens`` segments (the system
    prompt's ids shared by its group), so prefix caching meets the sharing and
    :func:`loadtest.workloads.from_sim` builds the token lists a measured run sends.

    The shape is that of SGLang's ``generated-shared-prefix`` benchmark dataset (groups of
    questions behind one long system prompt, ``python -m sglang.bench_serving``), with
    unshared long prompts mixed in so the prefill/decode split has something to separate.
    With the defaults about half of all prompt tokens are prefix hits after the first of each
    group (:func:`prefix_hit_share`).

    Raises:
        ValueError: ``system_tokens`` not a whole number of segments.
    """
    if system_tokens % segment_tokens:
        raise ValueError(f"system_tokens={system_tokens} is not a multiple of segment_tokens={segment_tokens}")
    rng = random.Random(seed)
    per_system = system_tokens // segment_tokens
    next_id = groups * per_system
    t, out = 0.0, []
    for i in range(n):
        if rng.random() < long_share:
            length, head = long_tokens, ()
        else:
            g = rng.randrange(groups)
            length, head = system_tokens + rng.randint(*question_tokens), tuple(range(g * per_system, (g + 1) * per_system))
        own = -(-(length - len(head) * segment_tokens) // segment_tokens)
        out.append(SimRequest(i, t, length, output_tokens, head + tuple(range(next_id, next_id + own)), segment_tokens))
        next_id += own
        t += rng.expovariate(rate_per_s)
    return out


def rescale(reqs: list[SimRequest], rate_per_s: float) -> list[SimRequest]:
    """The same requests with arrival times stretched to a mean rate of ``rate_per_s``."""
    if len(reqs) < 2 or reqs[-1].arrival_s <= 0:
        return reqs
    k = (len(reqs) - 1) / rate_per_s / reqs[-1].arrival_s
    return [SimRequest(r.idx, r.arrival_s * k, r.prompt_tokens, r.max_tokens, r.hash_ids, r.segment_tokens)
            for r in reqs]


def repeat(reqs: list[SimRequest], times: int) -> list[SimRequest]:
    """The trace played ``times`` times back to back (a 100k-request replay from a 20k trace);
    each copy's prompts are its own (no prefix shared across copies)."""
    if times <= 1 or not reqs:
        return reqs
    span = reqs[-1].arrival_s + (reqs[-1].arrival_s - reqs[0].arrival_s) / max(1, len(reqs) - 1)
    out = []
    for k in range(times):
        for r in reqs:
            ids = None if r.hash_ids is None else tuple(h * times + k for h in r.hash_ids)
            out.append(SimRequest(len(out), r.arrival_s + k * span, r.prompt_tokens, r.max_tokens, ids, r.segment_tokens))
    return out


def agentic(n: int, seed: int = 0, min_tokens: int = 8192, max_tokens: int = 32768,
            growth: tuple[float, float] = (0.25, 0.5), output_tokens: tuple[int, int] = (100, 400),
            system_tokens: int = 2048, segment_tokens: int = 512, think_s: tuple[float, float] = (2.0, 10.0),
            session_rate_per_s: float = 0.5) -> list[SimRequest]:
    """An agentic long-context mix (synthetic; the seeds' regime: "agents with large contexts"):
    sessions whose every turn resends the whole history and appends new tokens (tool output, the
    previous answer), so a turn's prompt is its predecessor's plus ``growth`` of it (a prefix hit
    of 1/(1+growth): 67-80 % for the default), starting at ``min_tokens`` (a shared
    ``system_tokens`` system prompt and the task) and ending before ``max_tokens``. Sessions start
    as a Poisson process; a session's next turn comes ``think_s`` after the previous one's arrival.
    Lengths are whole ``segment_tokens`` segments, each named by one hash id (shared system
    segments, then the session's own), so prefix caching meets the reuse. Arrival order, ``idx``
    by it. :func:`prefix_hit_share` gives the realized hit share (60-80 % with the defaults).
    """
    rng = random.Random(seed)
    system = tuple(range(system_tokens // segment_tokens))
    next_id = len(system)
    out: list[tuple[float, int, int, tuple[int, ...]]] = []
    start = 0.0
    while len(out) < n:
        start += rng.expovariate(session_rate_per_s)
        first = (min_tokens - system_tokens) // segment_tokens
        ids = system + tuple(range(next_id, next_id + first))
        next_id += first
        t = start
        while len(ids) * segment_tokens < max_tokens and len(out) < n:
            out.append((t, len(ids) * segment_tokens, rng.randint(*output_tokens), ids))
            add = max(1, round(len(ids) * rng.uniform(*growth)))
            ids = ids + tuple(range(next_id, next_id + add))
            next_id += add
            t += rng.uniform(*think_s)
    out.sort(key=lambda r: r[0])
    t0 = out[0][0]
    return [SimRequest(i, t - t0, length, m, ids, segment_tokens) for i, (t, length, m, ids) in enumerate(out)]


def prefix_hit_tokens(reqs: list[SimRequest], block_size: int) -> list[int]:
    """Per request, the prompt tokens in leading blocks an earlier request's prompt had (what
    an unbounded prefix cache shared by every worker would hit)."""
    seen: set[bytes] = set()
    out = []
    for r in reqs:
        hashes = r.block_hashes(block_size)
        k = 0
        while k < len(hashes) and hashes[k] in seen:
            k += 1
        seen.update(hashes)
        out.append(min(k * block_size, max(0, r.prompt_tokens - 1)))
    return out


def prefix_hit_share(reqs: list[SimRequest], block_size: int = 16) -> float:
    """Share of all prompt tokens that are prefix hits (:func:`prefix_hit_tokens`)."""
    total = sum(r.prompt_tokens for r in reqs)
    return sum(prefix_hit_tokens(reqs, block_size)) / max(1, total)
