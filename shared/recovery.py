"""Recovery from lost work: the ids under which a request's work items are de-duplicated, so
that a request resubmitted after a work-queue stream was lost is not dropped as a duplicate.

JetStream drops a work item whose ``Nats-Msg-Id`` it saw inside the duplicate window
(``shared/subjects.py``: ``<stage>:<request id>``). When a stream is lost (a broker restarted
without its storage, or declared the stream again before recovering it), its items and its
de-duplication memory go with it, while the other stages' streams still remember the request.
The gateway then resubmits the request with one more ``gateway.resubmitted`` mark in its
timeline; every stage derives the id of the work it publishes from that count
(:func:`work_id`), so the resubmitted request passes every stage's de-duplication once, and a
retried hand-off of one attempt is still dropped.
"""

from __future__ import annotations

#: The timeline mark a resubmission adds (``RequestMeta.marks``).
RESUBMITTED = "gateway.resubmitted"


def attempt(meta) -> int:
    """How many times the gateway resubmitted the request (0: never). ``meta``: a RequestMeta."""
    return sum(1 for name, _ in meta.marks if name == RESUBMITTED)


def work_id(meta) -> str:
    """The id (for ``Bus.publish_work``) of this attempt of the request's work items:
    ``<request id>`` on the first attempt, ``<request id>~<n>`` on the n-th resubmission."""
    n = attempt(meta)
    return meta.request_id if n == 0 else f"{meta.request_id}~{n}"
