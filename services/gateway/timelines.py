"""Per-request timelines at the gateway: the pipeline's marks merged with the gateway's own,
turned into phases that add up to the request's end-to-end time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.timeline import phases


@dataclass
class Timeline:
    """One API request's timeline (one entry per choice)."""

    request_id: str
    gateway_marks: list[tuple[str, float]]
    first_flush: float = 0.0
    ended_at: float = 0.0
    choices: list[dict] = field(default_factory=list)

    def end(self, choices) -> None:
        self.ended_at = time.time()
        received = self.gateway_marks[0][1]
        for c in choices:
            marks = [*self.gateway_marks, *c.marks, ("gateway.end", self.ended_at)]
            ph = phases(marks)
            self.choices.append({
                "index": c.index,
                "pipeline_request_id": c.request_id,
                "phases": [{"phase": name, "ms": round(s * 1e3, 3)} for name, s in ph],
                "sum_ms": round(sum(s for _, s in ph) * 1e3, 3),
                "marks": [{"mark": name, "at": t, "ms": round((t - received) * 1e3, 3)} for name, t in marks],
                "speculation": speculation(getattr(c, "spec_stats", None)),
            })

    @property
    def e2e_ms(self) -> float:
        return (self.ended_at - self.gateway_marks[0][1]) * 1e3

    def to_dict(self) -> dict:
        received = self.gateway_marks[0][1]
        return {
            "request_id": self.request_id,
            "e2e_ms": round(self.e2e_ms, 3),
            "ttft_ms": round((self.first_flush - received) * 1e3, 3) if self.first_flush else None,
            "choices": self.choices,
        }

    def header(self) -> str:
        """Compact phases of the first choice: ``gateway=0.4;queue.tokenizer=0.9;...;total=123.4`` (ms)."""
        if not self.choices:
            return ""
        parts = [f"{p['phase']}={p['ms']:.1f}" for p in self.choices[0]["phases"]]
        return ";".join([*parts, f"total={self.e2e_ms:.1f}"])


def speculation(stats) -> dict | None:
    """A choice's speculative decoding on the decode worker that finished it (``SpecStats``):
    drafts verified and accepted, the acceptance rate, and output tokens per engine step."""
    if stats is None:
        return None
    return {
        "draft_tokens": stats.num_draft_tokens,
        "accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": round(stats.num_accepted_tokens / stats.num_draft_tokens, 4) if stats.num_draft_tokens else None,
        "tokens_per_step": round(stats.num_tokens / stats.num_steps, 3) if stats.num_steps else None,
    }
