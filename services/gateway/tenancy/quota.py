"""A key's limits (:class:`Quota`) and the 429 a refused request gets."""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import Overloaded

#: Why a request was refused (the script's reason codes, in order).
REASONS = {1: "tokens", 2: "requests", 3: "concurrent"}


@dataclass(frozen=True, slots=True)
class Quota:
    """A key's limits; 0 means no limit. Rates are per ``window_s`` seconds."""

    tokens: int = 0
    requests: int = 0
    concurrent: int = 0
    window_s: float = 60.0

    @property
    def is_limited(self) -> bool:
        return bool(self.tokens or self.requests or self.concurrent)


def refusal(name: str, quota: Quota, reason: str, retry_after_s: float) -> Overloaded:
    """The 429 for a refused request (OpenAI's ``rate_limit_exceeded`` code)."""
    what = {"tokens": f"token rate limit of {quota.tokens} tokens",
            "requests": f"request rate limit of {quota.requests} requests"}.get(reason)
    if what is None:
        message = f"limit of {quota.concurrent} concurrent requests reached for key {name!r}"
    else:
        message = f"{what} per {quota.window_s:g} s reached for key {name!r}"
    return Overloaded(message, retry_after_s=retry_after_s, code="rate_limit_exceeded")
