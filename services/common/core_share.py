"""Cores where the work is: each model worker runs the threads of its host's idle model workers too.

On a small host ``pdserve up`` gives each model worker its share of the cores (on two cores: one
prefill thread, one decode thread). A long prompt that arrives while nothing decodes would then
run on one core while the other idles, and so would one stream's decode steps while no prompt is
being prefilled. But a worker that is busy must not lose its core to another that oversubscribes
it (every parallel region of its step would wait at a barrier for a descheduled thread:
docs/decisions.md, "Threads per model worker"). So each model worker publishes, in a small file
on the host's tmpfs, whether it has work and how many threads it runs (:class:`WorkerState`);
before each engine step it sets its torch threads to its own share plus its part of the threads of
the other model workers of its host that are idle (or dead) — split evenly among the workers that
are busy, so that no thread is borrowed twice — never more than the CPUs it may run on
(:class:`StepThreads`). Prefill borrows an idle decode worker's cores for a long prompt; decode
borrows an idle prefill worker's cores for its steps; a worker that gets work back takes its
cores back at its next step, and the borrower gives them back at its next look (at most
``LOOK_EVERY_S`` plus one step later). The kernels give bit-identical results at any thread
count (each output column and each attention tile is computed by one thread in a fixed order:
kernels/cpu/quant_block.h, kernels/cpu/paged_attention.cpp), so the answer does not depend on the
number of threads a step ran with. The rule and its measurements: docs/decisions.md, "Cores where
the work is".

The files live in ``<PD_SHM_DIR>/pdserve-cores-<namespace>/`` (one per model worker:
``<instance>.json`` = ``{"pid", "role", "threads", "busy", "since"}``, ``since`` on the host's
monotonic clock, which every process of the host shares), so workers of one deployment on one
host see each other and nothing else.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

#: Seconds between two looks at the other workers' files: about every decode step on a 2-core host
#: (a look reads a few small files, ~50 us), so a borrowed core goes back within one step of its
#: owner's next work.
LOOK_EVERY_S = 0.002
#: A worker lends its threads only once it has been idle this long: the short prompts of running
#: streams pass through prefill in tens of milliseconds, and a core lent and taken back at each
#: of them would make the borrower's steps contend at every switch (measured: docs/decisions.md,
#: "Cores where the work is").
LEND_AFTER_S = 0.05


def share_dir(shm_dir: str, namespace: str) -> Path:
    """The folder where a deployment's model workers on this host publish their state."""
    return Path(shm_dir) / f"pdserve-cores-{namespace}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerState:
    """A model worker's published state: busy (sequences to prefill or decode) or idle, its role
    and its own share of threads.

    Args:
        folder: :func:`share_dir`.
        instance: the worker's instance id (the file's name; the pid when empty).
        threads: its own share of torch threads (what it lends while idle).
        role: ``prefill`` or ``decode`` (informational: the rule is the same for both).
    """

    def __init__(self, folder: Path, instance: str, threads: int, role: str = ""):
        self.folder = folder
        self.path = folder / f"{instance or os.getpid()}.json"
        self.threads = threads
        self.role = role
        self.busy: bool | None = None
        folder.mkdir(parents=True, exist_ok=True)
        self.set(False)

    def set(self, busy: bool) -> None:
        """Publish ``busy`` (a write only when it changes: at most twice per burst of work)."""
        if busy == self.busy:
            return
        self.busy = busy
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "role": self.role, "threads": self.threads, "busy": busy,
                                   "since": time.monotonic()}))
        os.replace(tmp, self.path)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


class StepThreads:
    """A model worker's torch threads, step by step: ``base`` plus the threads of the host's other
    model workers that are idle or dead, at most ``max_threads``.

    Args:
        folder: :func:`share_dir`.
        base: the worker's own share (``PD_TORCH_THREADS``).
        max_threads: the CPUs it may run on.
        set_threads: applies a thread count (``torch.set_num_threads``).
        own: the worker's own :class:`WorkerState` file (not counted as a lender); None for a
            worker that only borrows.
    """

    def __init__(self, folder: Path, base: int, max_threads: int, set_threads=None, own: Path | None = None):
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.folder = folder
        self.base = max(1, base)
        self.max_threads = max(self.base, max_threads)
        self.set_threads = set_threads
        self.own = own.name if own is not None else None
        self.current = self.base
        self._looked = 0.0

    def lent(self) -> int:
        """Threads this worker may borrow now: the shares of the host's other model workers that
        have been idle for :data:`LEND_AFTER_S` (or whose process is gone), split evenly among the
        workers that are busy (this one and the others, in the order of their file names, the
        first ones taking the remainder), so that two borrowers never take the same thread."""
        idle, borrowers = 0, [self.own or ""]
        now = time.monotonic()
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return 0
        for name in names:
            if not name.endswith(".json") or name == self.own:
                continue
            try:
                state = json.loads((self.folder / name).read_text())
                pid, threads = int(state["pid"]), int(state.get("threads", 0))
                busy, since = bool(state.get("busy")), float(state.get("since") or 0.0)
            except (OSError, ValueError, TypeError, KeyError):
                continue  # being replaced, gone, or not a state file
            if pid <= 0:
                continue
            if not _alive(pid):
                (self.folder / name).unlink(missing_ok=True)  # its cores are free; a successor has a file of its own
                idle += threads
            elif busy:
                borrowers.append(name)
            elif now - since >= LEND_AFTER_S:
                idle += threads
        borrowers.sort()
        rank = borrowers.index(self.own or "")
        return idle // len(borrowers) + (1 if rank < idle % len(borrowers) else 0)

    def before_step(self) -> int:
        """Set the threads for the next step; returns them."""
        now = time.monotonic()
        if now - self._looked >= LOOK_EVERY_S:
            self._looked = now
            want = min(self.max_threads, self.base + self.lent())
            if want != self.current:
                self.set_threads(want)
                self.current = want
        return self.current
