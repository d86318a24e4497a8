"""How should tokens travel? Core NATS against JetStream, measured in one run.

A decode step emits one TokenChunk per running request; the postfilter must see it as soon
as possible. This benchmark sends real TokenChunk messages (msgpack, ~60 bytes) from a
publisher to a subscriber on the same NATS server three ways:

* core NATS publish → subscription callback (what pdserve uses);
* JetStream publish, awaiting the server's ack per token (what a durable token stream
  costs the decode loop) → ordered push consumer;
* JetStream publish with acks awaited per batch of 64 (a decode step of a 64-sequence batch).

It prints the one-way latency (p50/p99, publish → receive) at one token at a time, and the
throughput when 64 streams publish at once. ``pdserve bench bus [--n 2000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from nats.js import api as js_api

from shared import messages
from shared import nats_bus as bus
from shared.config import Settings


def _chunk(i: int) -> bytes:
    return messages.encode(messages.TokenChunk(request_id=f"chatcmpl-{i % 64:032x}", index=i, token_ids=[1234 + i % 100]))


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(n: int, settings: Settings) -> dict:
    nc = await bus.connect(settings, "pdserve-bench-bus", max_reconnect_attempts=0)
    js = nc.jetstream()
    ns = f"bench{uuid.uuid4().hex[:6]}"
    subject_core = f"{ns}.core"
    subject_js = f"{ns}.js"
    stream = f"{ns.upper()}_TOKENS"
    await js.add_stream(js_api.StreamConfig(name=stream, subjects=[subject_js], storage=js_api.StorageType.MEMORY,
                                            max_age=60))
    results: dict[str, dict] = {}
    try:
        # --- latency, one message at a time ---------------------------------------------------
        for mode in ("core", "jetstream"):
            got: asyncio.Queue = asyncio.Queue()

            async def on(msg, got=got) -> None:
                got.put_nowait(time.perf_counter())

            if mode == "core":
                sub = await nc.subscribe(subject_core, cb=on)
            else:
                sub = await js.subscribe(subject_js, cb=on, ordered_consumer=True)
            await asyncio.sleep(0.2)
            lat = []
            for i in range(n):
                t0 = time.perf_counter()
                if mode == "core":
                    await nc.publish(subject_core, _chunk(i))
                    await nc.flush()
                else:
                    await js.publish(subject_js, _chunk(i))
                t1 = await asyncio.wait_for(got.get(), 5)
                lat.append((t1 - t0) * 1e3)
            await sub.unsubscribe()
            results[mode] = {"p50_ms": statistics.median(lat), "p99_ms": _pct(lat, 0.99)}

        # --- throughput: 64 streams at once -----------------------------------------------------
        for mode in ("core", "jetstream", "jetstream-batched"):
            count = 0
            done = asyncio.Event()
            total = n * 4

            async def on_tp(msg, total=total, done=done) -> None:
                nonlocal count
                count += 1
                if count >= total:
                    done.set()

            subj = subject_core if mode == "core" else subject_js
            sub = await (nc.subscribe(subj, cb=on_tp) if mode == "core" else js.subscribe(subj, cb=on_tp, ordered_consumer=True))
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            if mode == "core":
                for i in range(total):
                    await nc.publish(subj, _chunk(i))
                await nc.flush()
            elif mode == "jetstream":
                for i in range(total):
                    await js.publish(subj, _chunk(i))
            else:
                for start in range(0, total, 64):
                    await asyncio.gather(*(js.publish(subj, _chunk(i)) for i in range(start, min(total, start + 64))))
            publish_s = time.perf_counter() - t0
            await asyncio.wait_for(done.wait(), 60)
            elapsed = time.perf_counter() - t0
            await sub.unsubscribe()
            results.setdefault(mode, {}).update({"msgs_per_s": total / elapsed, "publisher_us_per_msg": publish_s / total * 1e6})
    finally:
        await js.delete_stream(stream)
        await nc.close()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench bus")
    p.add_argument("--n", type=int, default=2000, help="messages per latency run (throughput runs use 4×)")
    args = p.parse_args(argv or [])
    settings = Settings.from_env()
    res = asyncio.run(run(args.n, settings))
    print(f"token transport over NATS at {settings.nats_url}, TokenChunk messages, n={args.n}")
    print(f"{'mode':<20} {'p50 latency ms':>15} {'p99 latency ms':>15} {'msgs/s (64 streams)':>20} {'publisher µs/msg':>17}")
    for mode in ("core", "jetstream", "jetstream-batched"):
        r = res.get(mode, {})
        p50 = f"{r['p50_ms']:.3f}" if "p50_ms" in r else "-"
        p99 = f"{r['p99_ms']:.3f}" if "p99_ms" in r else "-"
        print(f"{mode:<20} {p50:>15} {p99:>15} {r['msgs_per_s']:>20.0f} {r['publisher_us_per_msg']:>17.1f}")
    core, jst = res["core"], res["jetstream"]
    print(f"JetStream / core: latency ×{jst['p50_ms'] / core['p50_ms']:.1f}, "
          f"publisher cost ×{jst['publisher_us_per_msg'] / core['publisher_us_per_msg']:.1f}, "
          f"throughput ×{jst['msgs_per_s'] / core['msgs_per_s']:.2f}")
    return 0
