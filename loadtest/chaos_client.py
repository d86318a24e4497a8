"""The chaos suite's client: one streamed chat request and what became of it
(:class:`Outcome`), and closed-loop load from a few clients (:func:`run_load`)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx


@dataclass
class Outcome:
    status: str  # completed | failed | disconnected | hung | broken
    text: str = ""
    error: str = ""
    seconds: float = 0.0
    http_status: int = 200
    error_type: str = ""
    ttft_s: float | None = None  # to the first content token, for admitted streams


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                      leave_after: int | None, hang_s: float) -> Outcome:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    pieces: list[str] = []
    first: list[float | None] = [None]

    async def go() -> Outcome:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    err = json.loads(raw)["error"]
                    return Outcome("failed", error=f"{resp.status_code} {err.get('code')}: {err['message']}",
                                   http_status=resp.status_code, error_type=err.get("type") or "")
                except Exception:
                    return Outcome("broken", error=f"{resp.status_code} without an error object: {raw[:200]!r}",
                                   http_status=resp.status_code)
            seen = 0
            finished = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    return Outcome("completed" if finished else "broken", "".join(pieces),
                                   error="" if finished else "[DONE] before a finish_reason", ttft_s=first[0])
                event = json.loads(payload)
                if "error" in event:
                    return Outcome("failed", "".join(pieces), error=f"{event['error'].get('code')}: {event['error']['message']}",
                                   error_type=event["error"].get("type") or "", ttft_s=first[0])
                for choice in event["choices"]:
                    content = choice["delta"].get("content") or ""
                    if content and first[0] is None:
                        first[0] = time.monotonic() - started
                    pieces.append(content)
                    finished = finished or choice["finish_reason"] is not None
                seen += 1
                if leave_after is not None and seen >= leave_after:
                    return Outcome("disconnected", "".join(pieces))
            return Outcome("broken", "".join(pieces), error="stream ended without [DONE]")

    try:
        out = await asyncio.wait_for(go(), hang_s)
    except TimeoutError:
        out = Outcome("hung", "".join(pieces), error=f"no end after {hang_s:.0f}s")
    except httpx.HTTPError as exc:
        out = Outcome("broken", "".join(pieces), error=f"{type(exc).__name__}: {exc}")
    out.seconds = time.monotonic() - started
    if out.ttft_s is None:
        out.ttft_s = first[0]
    return out


async def run_load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                   leave_rate: float, hang_s: float, seed: int, keep_going=lambda: False) -> list[tuple[int, Outcome]]:
    """Send prompts in order (cycling) from ``concurrency`` clients until all were sent once
    and ``keep_going()`` is false. Returns (prompt index, outcome) per request."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency * 2)
    results: list[tuple[int, Outcome]] = []
    counter = iter(range(10**9))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(hang_s, connect=10), limits=limits) as client:
        async def client_loop():
            while True:
                i = next(counter)
                if i >= len(prompts) and not keep_going():
                    return
                leave = rng.randrange(1, max_tokens) if rng.random() < leave_rate else None
                k = i % len(prompts)
                results.append((k, await one_request(client, model, prompts[k], max_tokens, leave, hang_s)))

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return results
