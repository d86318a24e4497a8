"""``pdserve down`` / Ctrl-C ordering (services/launcher.py ``stop_all``, docs/operations.md
"Shutdown"): the gateways are stopped first and alone, and every other stage is sent SIGTERM
only once they have drained and exited, while it still runs behind them. On stand-in child
processes (a few lines of Python each, no model): each records when SIGTERM reached it and when
it exited; the gateway takes a drain of its own before exiting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from services import launcher
from services.deployment import Deployment, Proc
from shared.config import Settings

#: a stand-in service: on SIGTERM, note the time, take ``drain`` seconds, note the time, exit 0
STANDIN = textwrap.dedent("""
    import signal, sys, time
    out, drain = sys.argv[1], float(sys.argv[2])
    def on_term(*_):
        with open(out, "a") as fh:
            fh.write(f"term {time.time()}\\n")
        time.sleep(drain)
        with open(out, "a") as fh:
            fh.write(f"exit {time.time()}\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    open(out + ".ready", "w").close()
    while True:
        time.sleep(0.05)
""")
DRAIN_S = 1.0


def standin(tmp: Path, name: str, drain_s: float) -> Proc:
    out = tmp / f"{name}.txt"
    popen = subprocess.Popen([sys.executable, "-c", STANDIN, str(out), str(drain_s)])
    return Proc(name, popen, tmp / f"{name}.log")


def events(tmp: Path, name: str) -> dict[str, float]:
    return {kind: float(at) for kind, at in (line.split() for line in (tmp / f"{name}.txt").read_text().splitlines())}


def stopped_out_of_order(tmp_path: Path, stop) -> list[str]:
    """Start the stand-ins of a deployment, ``stop(dep)`` them; the non-gateway stages that were
    signalled before the last gateway exited (checking that the gateways' drain ran and nothing
    needed SIGKILL)."""
    names = ["tokenizer-0", "prefill-0", "decode-0", "postfilter-0", "gateway-0", "gateway-1"]
    procs = [standin(tmp_path, n, DRAIN_S if n.startswith("gateway") else 0.0) for n in names]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"{n}.txt.ready").exists() for n in names):  # handlers installed
            assert time.monotonic() < deadline, "stand-ins did not start"
            time.sleep(0.05)
        dep = Deployment(settings=Settings.from_env({}, shutdown_drain_s=DRAIN_S), state_dir=tmp_path, replicas={},
                         procs=procs, quiet=True)
        stop(dep)
    finally:
        for p in procs:
            if p.popen.poll() is None:
                p.popen.kill()
    assert all(p.popen.returncode == 0 for p in procs), [p.popen.returncode for p in procs]  # none SIGKILLed
    seen = {n: events(tmp_path, n) for n in names}
    gateways_done = max(seen[g]["exit"] for g in ("gateway-0", "gateway-1"))
    for g in ("gateway-0", "gateway-1"):
        assert seen[g]["exit"] - seen[g]["term"] >= DRAIN_S * 0.9  # the drain was let run
    return [n for n in names[:4] if seen[n]["term"] < gateways_done]


def test_stop_all_drains_the_gateways_before_any_other_stage_is_stopped(tmp_path):
    assert stopped_out_of_order(tmp_path, launcher.stop_all) == []


def test_the_check_fails_a_shutdown_that_stops_everything_at_once(tmp_path):
    """The broken variant: one SIGTERM to all at once (the pipeline is gone while the gateways
    still drain their streams) is caught."""
    from services.deployment import terminate

    def all_at_once(dep):
        terminate([p.popen for p in dep.procs], timeout_s=DRAIN_S + 10)

    assert stopped_out_of_order(tmp_path, all_at_once) == ["tokenizer-0", "prefill-0", "decode-0", "postfilter-0"]
