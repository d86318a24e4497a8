"""The reaper of the KV ledger (``shared/kv/ledger.py``), run by every prefill worker beside
its sweep of expired store values: each pass reads every record, judges it
(:func:`~shared.kv.ledger.orphan_reason`: lease over, deadline passed, request aborted, owner
dead) and reclaims the orphans (:func:`~shared.kv.ledger.reclaim`). Reapers on several workers
may run at once: a record is claimed by one of them only.

Owners are judged dead from the worker's heartbeat registry, and only once this worker has
listened for longer than two heartbeat timeouts (a worker that just started has heard nobody
yet and would take everyone for dead).
"""

from __future__ import annotations

import asyncio
import time

from shared.kv.ledger import KVLedger, ReapReport, orphan_reason, reclaim
from shared.metrics import kv_ledger_metrics


class KVReaper:
    """Reconciles the ledger of staged KV for one worker.

    Args:
        worker: a running :class:`~services.common.runtime.Worker` with a ``registry``
            (heartbeats heard), ``aborted`` (aborted request ids), ``instance_id``, ``started_at``.
        ledger, store: the ledger and the KV store it describes.
    """

    def __init__(self, worker, ledger: KVLedger, store):
        self.worker = worker
        self.ledger = ledger
        self.store = store
        self.metrics = kv_ledger_metrics()

    def _is_alive(self):
        """A liveness test of worker ids, or None while this worker cannot judge."""
        w = self.worker
        if time.time() - w.started_at < 2 * w.settings.heartbeat_timeout_s:
            return None
        alive = {w.instance_id}
        for stage in ("prefill", "decode"):
            alive.update(h.instance_id for h in w.registry.live(stage, ready_only=False))
        return alive.__contains__

    async def sweep(self) -> ReapReport:
        """One pass: judge every record, reclaim the orphans, update the gauges.

        Raises:
            KVTransferError: the ledger or the store cannot be reached.
        """
        entries = await asyncio.to_thread(self.ledger.entries)
        now = time.time()
        is_alive = self._is_alive()
        victims = []
        for entry in entries:
            reason = orphan_reason(entry, now, is_alive, self.worker.aborted.__contains__)
            if reason is not None:
                victims.append((entry, reason))
        report = await asyncio.to_thread(reclaim, self.ledger, self.store, victims) if victims else ReapReport()
        m = self.metrics
        for reason, (count, nbytes) in report.by_reason.items():
            m["orphaned"].labels(reason).inc(count)
            m["orphaned_bytes"].labels(reason).inc(nbytes)
            m["transitions"].labels("orphaned").inc(count)
        m["reclaimed_bytes"].inc(report.bytes_reclaimed)
        taken = {e.request_id for e, _ in victims}
        m["outstanding"].set(sum(e.request_id not in taken for e in entries))
        m["outstanding_bytes"].set(sum(e.bytes for e in entries if e.request_id not in taken))
        if report.num_orphaned:
            self.worker.log.info("kv_orphans_reclaimed", count=report.num_orphaned, bytes=report.bytes_orphaned,
                                 reclaimed_bytes=report.bytes_reclaimed,
                                 reasons={r: c for r, (c, _) in report.by_reason.items()})
        return report
