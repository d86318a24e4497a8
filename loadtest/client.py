"""An OpenAI-compatible streaming load client and the serving metrics computed from it.

Works against any server that speaks ``/v1/chat/completions`` or ``/v1/completions`` with SSE
(pdserve, llama.cpp's server, vLLM). Per request it records the send time, the arrival time of
every chunk that carries content, and the token counts; from those:

* **TTFT**: send → first *content* chunk (a role-only first chunk does not count);
* **ITL**: the gaps between consecutive content chunks;
* **TPOT**: (E2E − TTFT) / (output tokens − 1), the mean time per output token after the first;
* **E2E**: send → end of stream;
* requests/s and output tokens/s over the run's wall time;
* **goodput**: requests/s that met both a TTFT and a TPOT SLO (DistServe, Zhong et al., 2024).

Output tokens are the server's ``usage.completion_tokens`` when it reports usage
(``stream_options.include_usage``), else the number of content chunks.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class RequestSpec:
    """One request of a workload: when to send it (seconds from the start), what to send."""

    send_at: float
    prompt: str | list[int]
    max_tokens: int
    chat: bool = True
    tag: str = ""


@dataclass
class RequestResult:
    tag: str
    sent_at: float
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds after sent_at
    text: str = ""  # the streamed text (choice 0's deltas, in order)
    request_id: str = ""  # the gateway's X-Request-Id (for /debug/timeline)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0–100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass
class Summary:
    """Aggregate metrics of one run (seconds; rates per second)."""

    num_requests: int
    num_ok: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    goodput_rps: float
    ttft: dict
    itl: dict
    tpot: dict
    e2e: dict
    slo_ttft_s: float
    slo_tpot_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def _pcts(values: Sequence[float]) -> dict:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": statistics.fmean(values) if values else None}


def summarize(results: Sequence[RequestResult], wall_s: float, slo_ttft_s: float, slo_tpot_s: float) -> Summary:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft_s
            and (r.tpot_s is None or r.tpot_s <= slo_tpot_s)]
    return Summary(
        num_requests=len(results),
        num_ok=len(ok),
        wall_s=wall_s,
        requests_per_s=len(ok) / wall_s if wall_s else 0.0,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / wall_s if wall_s else 0.0,
        goodput_rps=len(good) / wall_s if wall_s else 0.0,
        ttft=_pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=_pcts([x for r in ok for x in r.itls]),
        tpot=_pcts([r.tpot_s for r in ok if r.tpot_s is not None]),
        e2e=_pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        slo_ttft_s=slo_ttft_s,
        slo_tpot_s=slo_tpot_s,
    )


async def send_one(client: httpx.AsyncClient, model: str, spec: RequestSpec, extra: dict | None = None,
                   timeout_s: float = 600.0) -> RequestResult:
    """Send one streamed request and time its chunks."""
    if spec.chat:
        path = "/v1/chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": spec.prompt}]}
    else:
        path = "/v1/completions"
        body = {"model": model, "prompt": spec.prompt}
    body.update({"max_tokens": spec.max_tokens, "stream": True, "temperature": 0,
                 "stream_options": {"include_usage": True}, **(extra or {})})
    started = time.perf_counter()
    result = RequestResult(tag=spec.tag, sent_at=time.time(), ok=False)
    chunks = 0
    try:
        async with client.stream("POST", path, json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return result
            result.request_id = resp.headers.get("x-request-id", "")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                now = time.perf_counter() - started
                usage = event.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                for choice in event.get("choices") or []:
                    text = choice.get("text") if not spec.chat else (choice.get("delta") or {}).get("content")
                    if text:
                        if not choice.get("index"):
                            result.text += text
                        chunks += 1
                        if result.ttft_s is None:
                            result.ttft_s = now
                        result.chunk_times.append(now)
        result.e2e_s = time.perf_counter() - started
        result.output_tokens = result.output_tokens or chunks
        result.ok = result.ttft_s is not None
        if not result.ok:
            result.error = "no content"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def first_choice_timeline(client: httpx.AsyncClient, result: RequestResult) -> dict | None:
    """The first choice of a pdserve request's ``/debug/timeline`` (its phases, speculation, ...),
    or None when the server has none for it (another server, no request id, or forgotten)."""
    if not result.ok or not result.request_id:
        return None
    resp = await client.get(f"/debug/timeline/{result.request_id}")
    if resp.status_code != 200:
        return None
    return (resp.json().get("choices") or [{}])[0]


async def run_workload(url: str, model: str, specs: Sequence[RequestSpec], *, concurrency: int | None = None,
                       extra: dict | None = None, progress: bool = True, timeout_s: float = 600.0
                       ) -> tuple[list[RequestResult], float]:
    """Send every request at its ``send_at`` (open loop), or — with ``concurrency`` — keep that
    many in flight (closed loop, ``send_at`` ignored). Returns the results and the wall time."""
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=max(64, (concurrency or 0) * 2), max_keepalive_connections=64)
    bar = tqdm(total=len(specs), desc="requests", unit="req", disable=not progress, leave=False)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s) as client:
        started = time.perf_counter()

        async def one(spec: RequestSpec) -> None:
            results.append(await send_one(client, model, spec, extra, timeout_s))
            bar.update(1)

        if concurrency:
            queue = list(specs)

            async def worker() -> None:
                while queue:
                    await one(queue.pop(0))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            async def scheduled(spec: RequestSpec) -> None:
                delay = spec.send_at - (time.perf_counter() - started)
                if delay > 0:
                    await asyncio.sleep(delay)
                await one(spec)

            await asyncio.gather(*(scheduled(s) for s in specs))
        wall = time.perf_counter() - started
    bar.close()
    return results, wall
