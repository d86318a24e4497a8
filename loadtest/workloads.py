"""Workloads: public trace replay and synthetic arrivals, as lists of :class:`RequestSpec`.

Prompts are token-id lists sent to ``/v1/completions`` (every OpenAI-compatible server
accepts them), so prompt lengths are exact and shared prefixes are shared token for token.

* Azure LLM inference traces 2023 (conversation and code; the Splitwise paper, Patel et al.,
  ISCA 2024; CC-BY 4.0): arrival times and prompt/output lengths.
* Mooncake traces (FAST 2025, Apache-2.0): arrival times, lengths and the hash ids of each
  prompt's 512-token blocks. Requests that list the same leading hash ids share that many
  blocks of prompt: each hash id becomes a fixed block of token ids, scaled to
  ``block_tokens`` tokens, so prefix caching meets real sharing.
* Poisson and gamma (bursty) arrivals with mixed prompt lengths.

The traces were recorded on far larger models and machines: replays scale time (``time_scale``
multiplies inter-arrival gaps) and cap lengths; every report states the scaling used.
"""

from __future__ import annotations

import csv
import json
import random

from loadtest.client import RequestSpec

# the trace files and their fitting are the simulator's too (sim/trace.py): one reading of each
from sim.trace import TOKEN_HIGH, TOKEN_LOW, Scaling, random_tokens, timestamp_s, token_range, trace_path  # noqa: F401


def azure(name: str, n: int, scaling: Scaling, seed: int = 0, start: int = 0, vocab_size: int | None = None
          ) -> list[RequestSpec]:
    """``n`` consecutive requests of an Azure 2023 trace (``azure2023_conv.csv`` or
    ``azure2023_code.csv``) from row ``start``."""
    rng = random.Random(seed)
    rows = []
    with open(trace_path(name)) as fh:
        for i, row in enumerate(csv.DictReader(fh)):
            if i < start:
                continue
            if len(rows) == n:
                break
            rows.append(row)
    t0 = timestamp_s(rows[0]["TIMESTAMP"])
    specs = []
    for row in rows:
        prompt = min(int(row["ContextTokens"]), scaling.max_prompt_tokens)
        output = max(1, min(int(row["GeneratedTokens"]), scaling.max_output_tokens))
        specs.append(RequestSpec(send_at=(timestamp_s(row["TIMESTAMP"]) - t0) * scaling.time_scale,
                                 prompt=random_tokens(rng, max(1, prompt), vocab_size), max_tokens=output, chat=False,
                                 tag=f"prompt={prompt}"))
    return specs


def mooncake(name: str, n: int, scaling: Scaling, seed: int = 0, vocab_size: int | None = None) -> list[RequestSpec]:
    """``n`` requests of a Mooncake trace with prefix sharing by hash id (see module doc)."""
    block = scaling.block_tokens or 64
    blocks: dict[int, list[int]] = {}

    def block_of(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            blocks[hash_id] = random_tokens(random.Random(seed * 1_000_003 + hash_id), block, vocab_size)
        return blocks[hash_id]

    specs = []
    with open(trace_path(name)) as fh:
        for line in fh:
            if len(specs) == n:
                break
            rec = json.loads(line)
            prompt: list[int] = []
            for h in rec["hash_ids"]:
                prompt.extend(block_of(h))
            length = min(max(1, rec["input_length"] * block // 512), scaling.max_prompt_tokens, len(prompt))
            output = max(1, min(rec["output_length"], scaling.max_output_tokens))
            specs.append(RequestSpec(send_at=rec["timestamp"] / 1000.0 * scaling.time_scale, prompt=prompt[:length],
                                     max_tokens=output, chat=False, tag=f"prompt={length}"))
    return specs


def synthetic(n: int, rate_per_s: float, prompt_lengths: list[tuple[int, float]], output_tokens: int,
              burstiness: float = 1.0, seed: int = 0, vocab_size: int | None = None) -> list[RequestSpec]:
    """``n`` requests arriving at ``rate_per_s``: Poisson when ``burstiness`` is 1, bursty
    (gamma inter-arrivals with shape 1/burstiness, the same mean) above 1. Prompt lengths are
    drawn from ``[(length, weight), ...]``."""
    rng = random.Random(seed)
    lengths, weights = zip(*prompt_lengths)
    t = 0.0
    specs = []
    shape = 1.0 / burstiness
    for _ in range(n):
        length = rng.choices(lengths, weights)[0]
        specs.append(RequestSpec(send_at=t, prompt=random_tokens(rng, length, vocab_size), max_tokens=output_tokens, chat=False,
                                 tag=f"prompt={length}"))
        t += rng.gammavariate(shape, 1.0 / (rate_per_s * shape))
    return specs


def from_sim(reqs, seed: int = 0, vocab_size: int | None = None, chat: bool = False) -> list[RequestSpec]:
    """The token lists a measured run sends for simulator requests (:class:`sim.trace.SimRequest`):
    each hash id becomes a fixed segment of ``segment_tokens`` random token ids (the same id, the
    same tokens: equal prefixes shared token for token, as the simulator's block hashes are);
    a request without hash ids gets a prompt of its own. ``seed`` picks the token content only:
    two seeds give the same lengths and arrivals with nothing shared between them (a repeat of a
    workload on a deployment whose prefix cache holds the previous one)."""
    segments: dict[int, list[int]] = {}
    specs = []
    for r in reqs:
        if r.hash_ids is None:
            prompt = random_tokens(random.Random(seed * 1_000_003 + 7 * r.idx + 1), r.prompt_tokens, vocab_size)
        else:
            prompt = []
            for h in r.hash_ids:
                if h not in segments:
                    segments[h] = random_tokens(random.Random(seed * 1_000_003 - h - 1), r.segment_tokens, vocab_size)
                prompt.extend(segments[h])
            prompt = prompt[:r.prompt_tokens]
        specs.append(RequestSpec(send_at=r.arrival_s, prompt=prompt, max_tokens=r.max_tokens, chat=chat,
                                 tag=f"prompt={r.prompt_tokens}"))
    return specs
