"""How should queued work of a cancelled request be dropped? Two ways, measured in one run on
the same NATS server (issue 30):

* **cancel set** (what pdserve does): the gateway broadcasts one ``Abort`` on core NATS; every
  worker adds the id to its set of cancelled requests; a worker that pulls the request's work
  item finds it there, acks it and computes nothing. Cost per cancelled item: one core publish
  (heard by every worker) + the item's pull, decode, set lookup and ack.
* **removal from the work queue**: whoever published the item deletes it from the JetStream
  stream by its sequence number (``STREAM.MSG.DELETE``, a request/reply to the server), so no
  worker ever pulls it. Cost per cancelled item: one JetStream API round trip.

Both start from ``--n`` queued TokenizeTasks (a real work-queue stream and durable pull
consumer of a scratch namespace) that are all cancelled; the table gives µs per cancelled
item, and the drain rate of the cancel set. ``pdserve bench cancel [--n 1000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from shared.config import Settings
from shared.messages import Abort, RequestMeta, SamplingParams, TokenizeTask, decode_as
from shared.nats_bus import NatsBus, publish_task

BATCH = 16  # what a PullConsumer fetches at once (services/common/consumer.py max_batch)


def _task(ns: str, i: int) -> TokenizeTask:
    now = time.time()
    meta = RequestMeta(request_id=f"{ns}-{i}", reply_to=f"{ns}.gateway.x.events", model="m", created_at=now,
                       deadline_at=now + 600)
    return TokenizeTask(meta=meta, prompt="a prompt of a few words " * 40, sampling=SamplingParams(max_tokens=16))


async def _fill(bus: NatsBus, queue, ns: str, n: int, offset: int) -> list[int]:
    """Queue n tasks; their stream sequence numbers."""
    seqs: list[int] = []
    for start in range(0, n, 64):
        acks = await asyncio.gather(*(publish_task(bus.js, queue, _task(ns, offset + i), f"{ns}-{offset + i}")
                                      for i in range(start, min(n, start + 64))))
        seqs.extend(a.seq for a in acks)
    return seqs


async def run(n: int, settings: Settings) -> dict:
    ns = f"benchcancel{uuid.uuid4().hex[:6]}"
    s = Settings.from_env({}, nats_url=settings.nats_url, namespace=ns)
    protocol = s.protocol()
    queue = protocol.tokenize
    bus = await NatsBus.connect(s, "pdserve-bench-cancel", max_reconnect_attempts=0)
    out: dict = {"n": n}
    try:
        await bus.ensure_queues([queue])
        # --- cancel set ----------------------------------------------------------------------
        await _fill(bus, queue, ns, n, 0)
        cancelled: set[str] = set()
        heard = asyncio.Event()

        async def on_abort(message) -> None:
            if isinstance(message, Abort):
                cancelled.add(message.request_id)
                if len(cancelled) == n:
                    heard.set()

        await bus.subscribe(protocol.abort, on_abort)
        started = time.perf_counter()
        for i in range(n):
            await bus.publish(protocol.abort, Abort(request_id=f"{ns}-{i}", reason="client_disconnected"))
        await asyncio.wait_for(heard.wait(), 30)
        broadcast_s = time.perf_counter() - started
        started = time.perf_counter()
        dropped = 0
        while dropped < n:
            for d in await bus.pull(queue, BATCH, timeout_s=2.0):
                task = decode_as(d.data, TokenizeTask)
                if task.meta.request_id in cancelled:
                    await d.ack()
                    dropped += 1
        drain_s = time.perf_counter() - started
        out["cancel_set"] = {"broadcast_us": broadcast_s / n * 1e6, "drain_us": drain_s / n * 1e6,
                             "items_per_s": n / drain_s}
        # --- removal from the work queue, one request at a time and pipelined ------------------
        for mode, width in (("removal", 1), ("removal_pipelined", 64)):
            seqs = await _fill(bus, queue, ns, n, n * (2 if width == 1 else 3))
            started = time.perf_counter()
            for k in range(0, n, width):
                await asyncio.gather(*(bus.js.delete_msg(queue.stream, q) for q in seqs[k:k + width]))
            removal_s = time.perf_counter() - started
            left = await bus.queue_depth(queue)
            out[mode] = {"delete_us": removal_s / n * 1e6, "left_in_queue": left}
    finally:
        try:
            await bus.js.delete_stream(queue.stream)
        except Exception:
            pass
        await bus.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench cancel")
    p.add_argument("--n", type=int, default=1000, help="queued work items cancelled per way")
    args = p.parse_args(argv or [])
    settings = Settings.from_env()
    res = asyncio.run(run(args.n, settings))
    cs, rm, rp = res["cancel_set"], res["removal"], res["removal_pipelined"]
    print(f"dropping {args.n} queued TokenizeTasks of cancelled requests, NATS at {settings.nats_url}")
    print(f"{'way':<28} {'µs per cancelled item':>22}  notes")
    print(f"{'cancel set: Abort broadcast':<28} {cs['broadcast_us']:>22.1f}  one core publish, heard by every worker")
    print(f"{'cancel set: pull+check+ack':<28} {cs['drain_us']:>22.1f}  fetches of {BATCH}: "
          f"{cs['items_per_s']:.0f} dropped items/s per worker")
    print(f"{'cancel set: total':<28} {cs['broadcast_us'] + cs['drain_us']:>22.1f}")
    print(f"{'removal (STREAM.MSG.DELETE)':<28} {rm['delete_us']:>22.1f}  one at a time; left in queue: "
          f"{rm['left_in_queue']}")
    print(f"{'removal, 64 in flight':<28} {rp['delete_us']:>22.1f}  left in queue: {rp['left_in_queue']}")
    return 0
