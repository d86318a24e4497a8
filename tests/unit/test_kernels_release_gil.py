"""The C++ kernels let go of the GIL while they compute (issue 12).

A model worker runs its engine on one thread and its event loop (token publishing, acks,
heartbeats) on another; a kernel call that kept the GIL froze the event loop for the whole
call, so a token waited behind the next decode step before it left the worker.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kernels.cpu import quant

pytestmark = pytest.mark.skipif(not quant.available(), reason="no C++ toolchain for the CPU kernels")


def _python_ran_mid_call(call) -> tuple[int, float]:
    """(times another Python thread ran in the middle third of ``call()``, the call's seconds).

    With the GIL held through a call, another thread can run only at its edges (a switch is
    forced at a bytecode boundary, after at most ``sys.getswitchinterval()``, 5 ms)."""
    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0)

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        time.sleep(0.02)
        started = time.perf_counter()
        call()
        ended = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    third = (ended - started) / 3
    return sum(started + third <= t <= ended - third for t in stamps), ended - started


def _kernel_call(kernel: str, rows: int):
    """A call of ``kernel`` over ``rows`` input rows (one thread), as a closure."""
    if kernel == "q4_linear":
        ext = quant.load()
        n, k = 4096, 2048
        x = torch.randn(rows, k)
        codes = torch.randint(0, 255, (n, k // 2), dtype=torch.uint8)
        d, m = torch.rand(n, k // 32).half(), torch.rand(n, k // 32).half()
        return lambda: ext.q4_linear(x, codes, d, m)
    ext = quant.load_fused()
    x, w = torch.randn(rows * 64, 2048), torch.rand(2048)
    return lambda: ext.rms_norm(x, w, 1e-5)


@pytest.mark.parametrize("kernel", ["q4_linear", "fused_rms_norm"])
def test_a_kernel_call_lets_other_python_threads_run(kernel):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = 32
        while True:  # a call long enough that its middle third is well past a 5 ms switch
            call = _kernel_call(kernel, rows)
            call()  # warm
            started = time.perf_counter()
            call()
            if time.perf_counter() - started >= 0.05 or rows >= 512:
                break
            rows *= 2
        ran, elapsed = _python_ran_mid_call(call)
    finally:
        torch.set_num_threads(threads)
    assert elapsed > 0.03, "the call is too short to tell"
    assert ran > 0, elapsed
