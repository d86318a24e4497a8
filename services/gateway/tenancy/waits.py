"""Admission by predicted wait: refuse now (503 + ``Retry-After``) what could not be served in
time, instead of queueing it behind work that will make it miss its deadline.

For each new request the gateway predicts how long it would queue, from what the stages say
in their heartbeats and what this gateway has admitted itself:

* **prefill backlog** (prompt tokens admitted and not yet prefilled, in tokens): the larger of
  what the prefill workers report still to compute (``Heartbeat.queued_prefill_tokens``: only
  work they have pulled) and what the gateways report admitted and before its first token
  (this gateway's own :class:`AdmittedBacklog`, live, plus the other gateways' heartbeats,
  which carry theirs in the same field) — the gateways also see the prompts still queued in
  JetStream, which no worker has counted yet;
* **prefill rate**: the sum of the prefill workers' measured rates
  (``Heartbeat.prefill_tokens_per_s``, an EWMA of their engine steps), or the decode workers'
  where no prefill worker runs (aggregated / conditional routing);
* **decode load**: when every decode slot is taken (``num_running`` ≥ ``capacity``) a new
  request also waits for one to free: about one average admitted request's output tokens
  times the measured decode step (``decode_step_s``). Its own output tokens count at that
  step only once a decode worker has measured one.

``queue_s = backlog / rate (+ decode slot wait)``; the request's own time is its prompt at one
worker's rate plus its output tokens at the decode step. The request is refused when
``queue_s`` exceeds ``PD_MAX_QUEUE_TIME_S`` (``queue_time_exceeded``) or queue + own time would
pass its deadline (``deadline_unreachable``), with ``Retry-After`` = the excess (the time the
backlog needs to drain that far).

**Fairness between keys** (the idea of llm-d's flow control, which queues each flow — a
fairness id — separately and cycles through the flows so one tenant cannot starve the others:
https://llm-d.ai/docs/dev/guides/flow-control). pdserve does not hold requests at the gateway,
so it applies the same max-min rule to admission instead: once the backlog would pass
:data:`FAIR_SHARE_ONSET` of its capacity (``PD_MAX_QUEUE_TIME_S`` × rate, in tokens), a key
that already has admitted backlog may not take more than an equal share of that capacity
among the *active* keys — those with admitted backlog here or refused in the last
:data:`ACTIVE_KEY_WINDOW_S`. A key with nothing queued is only ever refused by the queue-time
and deadline rules, so every key gets work in once the backlog drains, and the keys over their
share cannot take that room back. Per-key backlogs are this gateway's own (keys are not shared
across gateways' heartbeats).

Estimated prompt tokens: the gateway does not tokenize on the request path; it counts
characters and divides by a characters-per-token ratio learned from the tokenizer's own counts
(``Accepted.num_prompt_tokens`` of the requests it served), with token id prompts counted
exactly.

Prefix-cache hits: what a prompt adds to the backlog is the part prefill will compute, not its
length. The gateway cannot see which blocks a worker holds when it admits, so it counts each
admitted prompt at the share of prompt tokens its finished requests did compute
(their usage's ``prompt_tokens - cached_tokens`` over ``prompt_tokens``, token-weighted EWMAs:
:meth:`WaitAdmission.learn_cached`). The share is one per gateway, across keys: a key whose
prompts all hit lowers it for the others (bounded by :data:`MIN_COMPUTED_SHARE`). The workers'
own ``queued_prefill_tokens`` still count a queued prompt whole until it is scheduled.
Without it a deployment whose requests share long system prompts refused work for a predicted
queue of 61 s while the requests it served waited 20-30 s (issue 34, the ``prefix`` runs).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

from shared.config import Settings
from shared.errors import Overloaded
from shared.messages import Heartbeat, TokenizeTask
from shared.metrics import admission_metrics

#: Prefill rate assumed for a worker that has not measured one yet (tokens/s): the tokenizer
#: router's default (``services/tokenizer/router.py``), SmolLM2-135M on one core.
DEFAULT_PREFILL_TOKENS_PER_S = 400.0
#: Decode step assumed before a decode worker has measured one (s).
DEFAULT_DECODE_STEP_S = 0.05
#: Output tokens assumed per admitted request when the gateway has none open.
DEFAULT_OUTPUT_TOKENS = 64
#: Characters per prompt token before any has been measured: English BPE text runs ~4; 3 errs
#: towards more tokens (a longer predicted wait).
INITIAL_CHARS_PER_TOKEN = 3.0
#: Tokens a chat template adds around each message and to the prompt (role markers, a
#: default system prompt).
TEMPLATE_TOKENS_PER_MESSAGE = 4
TEMPLATE_TOKENS = 24
#: Fraction of the backlog capacity above which per-key shares apply.
FAIR_SHARE_ONSET = 0.5
#: A key refused this recently still counts as waiting (active) for the shares.
ACTIVE_KEY_WINDOW_S = 10.0
#: Longest Retry-After given (s).
MAX_RETRY_AFTER_S = 60.0
#: Weight of one finished request in the EWMA of the computed share of prompt tokens.
COMPUTED_SHARE_WEIGHT = 0.1
#: Least computed share assumed (a prompt is never free: its last token is always computed,
#: and a cache can be evicted between two requests).
MIN_COMPUTED_SHARE = 0.05


class QueueFull(Overloaded):
    """The predicted wait is over the limit or past the deadline (503 + ``Retry-After``)."""

    status = 503
    type = "overloaded"
    code = "queue_time_exceeded"


def request_deadline_at(tasks: list[TokenizeTask]) -> float:
    """The deadline (unix seconds) of an API request: its tasks' ``meta.deadline_at``, which
    the gateway sets from ``PD_REQUEST_TIMEOUT_S`` (``services/gateway/parse.py``). The one
    place admission reads a deadline from."""
    return min(t.meta.deadline_at for t in tasks)


@dataclass(slots=True)
class Prediction:
    """What a new request would wait (seconds) and why.

    ``queue_s`` = ``prefill_queue_s`` (the prefill backlog at the prefill rate) +
    ``decode_slot_s`` (waiting for a decode slot); ``own_s`` is the request's own prefill and
    decode time; ``backlog_tokens`` and ``rate_tokens_per_s`` are the inputs.
    """

    backlog_tokens: int
    rate_tokens_per_s: float
    prefill_queue_s: float
    decode_slot_s: float
    prefill_s: float
    decode_s: float

    @property
    def queue_s(self) -> float:
        return self.prefill_queue_s + self.decode_slot_s

    @property
    def own_s(self) -> float:
        return self.prefill_s + self.decode_s

    def describe(self) -> str:
        return (f"predicted queue {self.queue_s:.1f}s: {self.backlog_tokens} prompt tokens to compute ahead at "
                f"{self.rate_tokens_per_s:.0f} tokens/s" + (f" + {self.decode_slot_s:.1f}s for a decode slot"
                                                            if self.decode_slot_s else ""))


@dataclass(slots=True)
class _Entry:
    key: str
    prompt_tokens: int  # in the prefill backlog until its first token; 0 after
    output_tokens: int


@dataclass(slots=True)
class AdmittedBacklog:
    """This gateway's admitted requests: prompt tokens before their first token (the prefill
    backlog it is responsible for), per key, and the output tokens reserved by all open ones."""

    entries: dict[str, _Entry] = field(default_factory=dict)
    per_key: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0

    def add(self, request_id: str, key: str, prompt_tokens: int, output_tokens: int) -> None:
        self.remove(request_id)
        self.entries[request_id] = _Entry(key, prompt_tokens, output_tokens)
        self.per_key[key] += prompt_tokens
        self.prompt_tokens += prompt_tokens

    def prefilled(self, request_id: str) -> _Entry | None:
        """The request's first token came: its prompt leaves the backlog (it stays open)."""
        entry = self.entries.get(request_id)
        if entry is None or not entry.prompt_tokens:
            return None
        self._take(entry)
        return entry

    def remove(self, request_id: str) -> None:
        entry = self.entries.pop(request_id, None)
        if entry is not None:
            self._take(entry)

    def _take(self, entry: _Entry) -> None:
        self.per_key[entry.key] -= entry.prompt_tokens
        if self.per_key[entry.key] <= 0:
            del self.per_key[entry.key]
        self.prompt_tokens -= entry.prompt_tokens
        entry.prompt_tokens = 0

    def mean_output_tokens(self) -> float:
        if not self.entries:
            return DEFAULT_OUTPUT_TOKENS
        return sum(e.output_tokens for e in self.entries.values()) / len(self.entries)


class WaitAdmission:
    """Predicts a new request's wait and admits or refuses it.

    Args:
        settings: ``max_queue_time_s`` (0 = no limit on the predicted queue time; the
            deadline still applies) and ``admission_fair_share``.
    """

    def __init__(self, settings: Settings):
        self.max_queue_time_s = settings.max_queue_time_s
        self.fair_share = settings.admission_fair_share
        self.backlog = AdmittedBacklog()
        self.chars_per_token = INITIAL_CHARS_PER_TOKEN
        # EWMAs of served prompts' computed and prompt tokens (learn_cached); their ratio is the
        # share of an admitted prompt's tokens prefill is expected to compute
        self._computed_ewma = 0.0
        self._prompt_ewma = 0.0
        self.refused_at: dict[str, float] = {}  # key → monotonic time of its last refusal
        self.metrics = admission_metrics()

    # --- estimates ---------------------------------------------------------------------------
    def prompt_chars(self, task: TokenizeTask) -> int:
        if task.messages is not None:
            return sum(len(m.content) for m in task.messages)
        return len(task.prompt or "")

    def estimate_prompt_tokens(self, task: TokenizeTask) -> int:
        """Prompt tokens of one task: exact for token ids, else characters / the learned ratio
        (+ the chat template's tokens)."""
        if task.prompt_token_ids is not None:
            return len(task.prompt_token_ids)
        tokens = math.ceil(self.prompt_chars(task) / self.chars_per_token)
        if task.messages is not None:
            tokens += TEMPLATE_TOKENS + TEMPLATE_TOKENS_PER_MESSAGE * len(task.messages)
        return max(1, tokens)

    def learn(self, chars: int, num_prompt_tokens: int, task: TokenizeTask | None = None) -> None:
        """Update the characters-per-token ratio from a prompt the tokenizer counted (EWMA, 0.1)."""
        overhead = 0
        if task is not None and task.messages is not None:
            overhead = TEMPLATE_TOKENS + TEMPLATE_TOKENS_PER_MESSAGE * len(task.messages)
        tokens = num_prompt_tokens - overhead
        if chars < 64 or tokens <= 0:
            return  # too short to say anything about the text's ratio
        self.chars_per_token = 0.9 * self.chars_per_token + 0.1 * min(8.0, max(1.0, chars / tokens))

    def learn_cached(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Learn from one served prefill (``prompt_tokens``, of which ``cached_tokens`` came from
        the prefix cache or the KV store): EWMAs (weight :data:`COMPUTED_SHARE_WEIGHT`) of the
        computed and the prompt tokens, so the share is weighted by tokens (a long prompt's hits
        count for more than a short one's), as the backlog it scales is."""
        if prompt_tokens <= 0:
            return
        computed = prompt_tokens - min(max(0, cached_tokens), prompt_tokens)
        w = COMPUTED_SHARE_WEIGHT
        self._computed_ewma += w * (computed - self._computed_ewma)
        self._prompt_ewma += w * (prompt_tokens - self._prompt_ewma)

    @property
    def computed_share(self) -> float:
        """Expected share of an admitted prompt's tokens that prefill computes: 1.0 before any
        request finished, else the EWMAs' ratio, within [:data:`MIN_COMPUTED_SHARE`, 1]."""
        if self._prompt_ewma <= 0:
            return 1.0
        return min(1.0, max(MIN_COMPUTED_SHARE, self._computed_ewma / self._prompt_ewma))

    def backlog_tokens(self, prompt_tokens: int) -> int:
        """Prompt tokens an admitted prompt of ``prompt_tokens`` adds to the prefill backlog: its
        expected computed part (:attr:`computed_share`, learned from finished requests)."""
        return math.ceil(prompt_tokens * self.computed_share)

    # --- prediction --------------------------------------------------------------------------
    def predict(self, prompt_tokens: int, output_tokens: int, heartbeats: dict[str, list[Heartbeat]],
                own_instance: str = "") -> Prediction:
        """The wait of a request of ``prompt_tokens`` and ``output_tokens`` given the live
        heartbeats by stage (``prefill``, ``decode``, ``gateway``)."""
        prefill = heartbeats.get("prefill") or []
        decode = heartbeats.get("decode") or []
        prefillers = prefill or decode  # no prefill worker: decode workers prefill
        rates = [h.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S for h in prefillers] or [
            DEFAULT_PREFILL_TOKENS_PER_S]
        rate = sum(rates)
        worker_side = sum(h.queued_prefill_tokens for h in prefillers)
        gateway_side = self.backlog.prompt_tokens + sum(
            h.queued_prefill_tokens for h in heartbeats.get("gateway") or [] if h.instance_id != own_instance)
        backlog = max(worker_side, gateway_side)
        steps = [h.decode_step_s for h in decode if h.decode_step_s > 0]
        measured = bool(steps)
        step_s = sum(steps) / len(steps) if measured else DEFAULT_DECODE_STEP_S
        running, capacity = sum(h.num_running for h in decode), sum(h.capacity for h in decode)
        slot_s = 0.0
        if capacity and running >= capacity:
            slot_s = step_s * self.backlog.mean_output_tokens() * (running - capacity + 1) / capacity
        return Prediction(backlog_tokens=backlog, rate_tokens_per_s=rate, prefill_queue_s=backlog / rate,
                          decode_slot_s=slot_s, prefill_s=prompt_tokens / (rate / len(rates)),
                          decode_s=output_tokens * step_s if measured else 0.0)

    # --- admission ---------------------------------------------------------------------------
    def check(self, key: str, tasks: list[TokenizeTask], output_tokens: int, heartbeats: dict[str, list[Heartbeat]],
              own_instance: str = "", now: float | None = None) -> tuple[int, Prediction]:
        """Admit (returns the request's estimated prompt tokens and the prediction) or refuse.

        Raises:
            QueueFull: ``queue_time_exceeded``, ``deadline_unreachable`` or
                ``fair_share_exceeded`` (503, with ``retry_after_s``).
        """
        now = time.time() if now is None else now
        tokens = sum(self.estimate_prompt_tokens(t) for t in tasks)
        p = self.predict(tokens, output_tokens, heartbeats, own_instance)
        self.metrics["predicted_wait"].observe(p.queue_s)
        limit_s = self.max_queue_time_s
        if limit_s and p.queue_s > limit_s:
            self._refuse(key, "queue_time_exceeded", p.queue_s - limit_s,
                         f"the server is overloaded: {p.describe()}, over the limit of {limit_s:.0f}s")
        left_s = request_deadline_at(tasks) - now
        if p.queue_s + p.own_s > left_s:
            self._refuse(key, "deadline_unreachable", p.queue_s + p.own_s - left_s,
                         f"the server is overloaded: {p.describe()} + {p.own_s:.1f}s of its own work would "
                         f"pass the request's deadline in {max(0.0, left_s):.0f}s")
        if self.fair_share:
            # the backlog holds the computed part of each prompt: compare like with like
            self._check_share(key, self.backlog_tokens(tokens), p, limit_s or max(0.0, left_s))
        return tokens, p

    def _check_share(self, key: str, tokens: int, p: Prediction, limit_s: float) -> None:
        capacity = limit_s * p.rate_tokens_per_s
        mine = self.backlog.per_key.get(key, 0)
        if not mine or p.backlog_tokens + tokens <= FAIR_SHARE_ONSET * capacity:
            return
        active = self.active_keys() | {key}
        if len(active) < 2:
            return
        share = capacity / len(active)
        if mine + tokens > share:
            self._refuse(key, "fair_share_exceeded", (mine + tokens - share) / p.rate_tokens_per_s,
                         f"this key has {mine} prompt tokens to compute queued, over its share of {share:.0f} among "
                         f"{len(active)} keys waiting ({p.describe()})")

    def active_keys(self, now_mono: float | None = None) -> set[str]:
        """Keys with admitted backlog here or refused in the last ACTIVE_KEY_WINDOW_S."""
        now_mono = time.monotonic() if now_mono is None else now_mono
        for k in [k for k, at in self.refused_at.items() if now_mono - at > ACTIVE_KEY_WINDOW_S]:
            del self.refused_at[k]
        return set(self.backlog.per_key) | set(self.refused_at)

    def _refuse(self, key: str, code: str, excess_s: float, message: str) -> None:
        self.refused_at[key] = time.monotonic()
        self.metrics["decisions"].labels("refused", code).inc()
        raise QueueFull(message, code=code, retry_after_s=min(MAX_RETRY_AFTER_S, max(1.0, excess_s)))

    def admitted(self, request_id: str, key: str, prompt_tokens: int, output_tokens: int) -> None:
        """Count an admitted request in the backlog (until its first token / its end), at the
        computed part of its ``prompt_tokens`` (:meth:`backlog_tokens`)."""
        self.backlog.add(request_id, key, self.backlog_tokens(prompt_tokens), output_tokens)
        self.metrics["decisions"].labels("admitted", "ok").inc()
        self.metrics["backlog_tokens"].set(self.backlog.prompt_tokens)

    def first_token(self, request_id: str, task: TokenizeTask | None = None, num_prompt_tokens: int = 0) -> None:
        """The request's first token arrived: its prompt leaves the backlog; its tokenizer
        count (``num_prompt_tokens``, 0 when unknown) teaches the characters-per-token ratio."""
        entry = self.backlog.prefilled(request_id)
        if entry is not None and num_prompt_tokens and task is not None and task.prompt_token_ids is None:
            self.learn(self.prompt_chars(task), num_prompt_tokens, task)
        self.metrics["backlog_tokens"].set(self.backlog.prompt_tokens)

    def finished(self, request_id: str) -> None:
        self.backlog.remove(request_id)
        self.metrics["backlog_tokens"].set(self.backlog.prompt_tokens)
