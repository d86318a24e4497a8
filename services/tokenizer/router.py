"""Conditional disaggregation: should this prompt be prefilled by a prefill worker (remote)
or by the decode worker that will decode it (local)?

Splitting prefill from decode protects everyone's inter-token latency from long prompts, but
costs a hand-off: two work-queue hops, staging the prompt's KV and loading it again. For a
short prompt the hand-off can cost more than the prefill itself, and prefilling it locally
stalls the decode batch only briefly (DistServe, Zhong et al., 2024; Splitwise, Patel et al.,
2024; vLLM's and Dynamo's conditional disaggregation). The cost model, per request:

* ``n_new`` = prompt tokens not already in the KV store (both paths reuse staged blocks);
* remote = queue wait (prompt tokens queued at the prefill workers / their rate)
  + ``n_new`` / prefill rate + KV transfer (prompt bytes / measured staging bandwidth)
  + the hop overhead;
* local = ``n_new`` / decode worker's prefill rate, counted once for the new request and once
  for every sequence running on that worker (each of their next tokens waits for it).

Local wins when its cost is lower *and* ``n_new`` is at most ``PD_ROUTER_LOCAL_MAX_TOKENS``
(the crossover prompt length measured on this machine, which bounds how long any local prefill
normally stalls a decode batch). A longer prompt goes local only when the prefill workers are
so backed up that remote costs more than ``OVERFLOW_MARGIN`` times local: then the stall is
the lesser harm (it keeps TTFT, and so goodput, from collapsing when prefill is the
bottleneck). Rates come from the workers' heartbeats (measured), with defaults
until the first measurements arrive. Every decision carries its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages import Heartbeat

#: Defaults until workers report measurements (SmolLM2-135M, fp32, one core of this machine).
DEFAULT_PREFILL_TOKENS_PER_S = 400.0
DEFAULT_KV_BANDWIDTH_BYTES_PER_S = 1.0e9
#: Two JetStream hops, a store round trip and decode's admission (measured: pdserve bench pipeline).
HOP_OVERHEAD_S = 0.02
#: A prompt over the local limit is prefilled locally only when remote costs this many times more.
OVERFLOW_MARGIN = 2.0


@dataclass(frozen=True, slots=True)
class RouteDecision:
    target: str  # "remote" | "local"
    reason: str
    local_s: float
    remote_s: float


class Router:
    """Per-request choice between remote and local prefill.

    Args:
        local_max_tokens: the longest ``n_new`` ever prefilled locally.
        kv_bytes_per_token: KV bytes one prompt token costs to stage and load.
        kv_bandwidth_bytes_per_s: staging + loading throughput of the KV hand-off (bytes/s).
        hop_overhead_s: the remote path's fixed cost (seconds): its extra work-queue hop, the
            store round trip and decode's admission. The simulator passes both from its
            profile (:class:`sim.simulator.Simulation`); a live tokenizer uses the defaults.
    """

    def __init__(self, local_max_tokens: int, kv_bytes_per_token: int,
                 kv_bandwidth_bytes_per_s: float = DEFAULT_KV_BANDWIDTH_BYTES_PER_S,
                 hop_overhead_s: float = HOP_OVERHEAD_S):
        self.local_max_tokens = local_max_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.kv_bandwidth_bytes_per_s = kv_bandwidth_bytes_per_s
        self.hop_overhead_s = hop_overhead_s

    def decide(self, num_prompt_tokens: int, num_cached_tokens: int, prefill: list[Heartbeat],
               decode: list[Heartbeat]) -> RouteDecision:
        """Where to prefill a prompt of ``num_prompt_tokens``, ``num_cached_tokens`` of which
        are already staged, given the live prefill and decode workers' heartbeats."""
        n_new = max(1, num_prompt_tokens - num_cached_tokens)
        if not prefill:
            return RouteDecision("local", "no prefill worker is alive", 0.0, float("inf"))
        if not decode:
            return RouteDecision("remote", "no decode worker is alive", float("inf"), 0.0)
        prefill_rate = sum(h.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S for h in prefill)
        queue_s = sum(h.queued_prefill_tokens for h in prefill) / prefill_rate
        per_worker_rate = prefill_rate / len(prefill)
        transfer_s = num_prompt_tokens * self.kv_bytes_per_token / self.kv_bandwidth_bytes_per_s
        remote_s = queue_s + n_new / per_worker_rate + transfer_s + self.hop_overhead_s
        target = min(decode, key=lambda h: h.num_running)  # JetStream hands work to whoever pulls; the idlest does
        local_rate = target.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        local_one = n_new / local_rate
        local_s = local_one * (1 + target.num_running)
        facts = (f"{n_new} tokens to compute; local {local_one * 1e3:.0f} ms × (1 + {target.num_running} running) = "
                 f"{local_s * 1e3:.0f} ms vs remote {remote_s * 1e3:.0f} ms (queue {queue_s * 1e3:.0f} ms, "
                 f"transfer {transfer_s * 1e3:.0f} ms)")
        if n_new > self.local_max_tokens:
            # only a queue at the prefill workers overrides the limit: with idle prefill workers
            # a fast model would otherwise always look cheaper locally (the fixed hop cost)
            if queue_s > 0 and local_s * OVERFLOW_MARGIN < remote_s:
                return RouteDecision("local", f"prefill workers backed up: {facts}", local_s, remote_s)
            return RouteDecision("remote", f"longer than the local limit of {self.local_max_tokens}: {facts}",
                                 local_s, remote_s)
        if local_s <= remote_s:
            return RouteDecision("local", f"cheaper locally: {facts}", local_s, remote_s)
        return RouteDecision("remote", f"cheaper remotely: {facts}", local_s, remote_s)
