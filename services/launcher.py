"""``pdserve up`` / ``down``: start and stop a whole pdserve deployment on one machine.

``up`` makes sure the model is converted, finds (or starts) NATS with JetStream, starts every
service as its own ``python -m services.<stage>`` process (with the requested replicas),
waits until the gateway reports ready and counts every started worker live, and prints the
URL. In the foreground, Ctrl-C stops
everything; with ``--detach`` it returns once ready and ``pdserve down`` stops it later.
State (pids, logs, a NATS store it started) lives in ``--state-dir`` (default ``.pdserve``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from services.deployment import Deployment, Proc, terminate  # noqa: F401 (Deployment and terminate re-exported)
from services.local_infra import ensure_nats, ensure_redis
from shared.config import Settings

STAGES = ("tokenizer", "prefill", "decode", "postfilter", "gateway")
MODEL_STAGES = ("prefill", "decode")
#: the stages whose live workers the gateway's /health/ready body counts
WORKER_STAGES = ("tokenizer", "prefill", "decode", "postfilter")


def torch_threads(settings: Settings, replicas: dict[str, int], stage: str = "") -> int:
    """Torch threads per model worker: prefill workers share the cores out among all model
    workers; decode workers share every core but one among themselves (at one stream an idle
    prefill worker's core would otherwise sit unused, and the core left over serves the
    pipeline's other processes; measured in docs/decisions.md, "Threads per model worker")."""
    if settings.torch_threads > 0:
        return settings.torch_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if stage == "decode":
        # one core left to the pipeline's other processes (postfilter, gateway, NATS, the decode
        # worker's own event loop): each of their wake-ups per token otherwise preempts one of
        # the step's threads and stalls the other at the next barrier
        return max(1, (cores - 1) // max(1, replicas.get("decode", 0)))
    workers = sum(replicas.get(s, 0) for s in MODEL_STAGES)
    return max(1, cores // max(1, workers))


def command_of(settings: Settings, stage: str) -> list[str]:
    """The module (and arguments) that runs ``stage``: ``services.<stage>``, or the stage runner
    with the class of a pluggable pre-stage (``stage-<name>``)."""
    if stage.startswith("stage-"):
        from services.plugins.api import refs, stage_name

        ref = next(r for r in refs(settings.pre_stages) if f"stage-{stage_name(r)}" == stage)
        return ["-m", "services.prompt_stage", ref]
    return ["-m", f"services.{stage}"]


def all_stages(settings: Settings) -> list[str]:
    """Every service of a deployment: the pluggable pre-stages, then the built-in five."""
    from services.plugins.api import refs, stage_name

    return [*(f"stage-{stage_name(r)}" for r in refs(settings.pre_stages)), *STAGES]


def spawn(dep: Deployment, name: str) -> Proc:
    """Start one service process (``name`` is ``<stage>-<i>``), logging to ``logs/<name>.log``."""
    stage = name.rsplit("-", 1)[0]
    threads = torch_threads(dep.settings, dep.replicas, stage)
    env = dict(os.environ)
    env.update(dep.settings.to_env())
    env["PD_INSTANCE_ID"] = f"{name}-{os.urandom(3).hex()}"
    env["PD_METRICS_PORT"] = "0" if stage != "gateway" else str(dep.settings.metrics_port)
    env["PD_TORCH_THREADS"] = str(threads)
    if name in dep.affinity:
        env["PD_CPU_AFFINITY"] = dep.affinity[name]
        threads = min(threads, dep.affinity[name].count(",") + 1)  # pinned: no more threads than its CPUs
        env["PD_TORCH_THREADS"] = str(threads)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no tqdm bars inside JSON logs
    env.setdefault("HF_HUB_OFFLINE", "1")  # models are local folders; never reach a hub
    log_path = dep.state_dir / "logs" / f"{name}.log"
    log = open(log_path, "ab")
    log.write(f"\n=== pdserve {time.strftime('%Y-%m-%dT%H:%M:%S')} start {name} ===\n".encode())
    log.flush()
    popen = subprocess.Popen([sys.executable, *command_of(dep.settings, stage)], env=env, stdout=log,
                             stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    log.close()
    return Proc(name, popen, log_path)


def start_services(dep: Deployment) -> None:
    for stage in all_stages(dep.settings):
        for i in range(dep.replicas.get(stage, 1)):
            dep.procs.append(spawn(dep, f"{stage}-{i}"))
    dep.say("started " + ", ".join(f"{p.name} (pid {p.popen.pid})" for p in dep.procs)
            + f"; logs in {dep.state_dir / 'logs'}")


class Supervisor:
    """Restarts service processes that exit while the deployment runs, with a back-off that
    doubles per quick crash (1 s … 30 s) and resets after a minute of running."""

    def __init__(self, dep: Deployment):
        self.dep = dep
        self.backoff: dict[str, float] = {}
        self.due: dict[str, float] = {}
        self.restarts: dict[str, int] = {}

    def poll(self) -> list[str]:
        """Restart what has died (once its back-off has passed); returns names restarted."""
        now = time.monotonic()
        restarted = []
        for i, p in enumerate(self.dep.procs):
            code = p.popen.poll()
            if code is None:
                if now - p.started_at > 60:
                    self.backoff.pop(p.name, None)
                continue
            if p.name not in self.due:
                delay = self.backoff.get(p.name, 0.0)
                self.backoff[p.name] = min(30.0, max(1.0, delay * 2))
                self.due[p.name] = now + delay
                self.dep.say(f"{p.name} exited with {code}; restarting in {delay:.0f}s (log: {p.log_path})")
            if now >= self.due[p.name]:
                del self.due[p.name]
                self.dep.procs[i] = spawn(self.dep, p.name)
                self.restarts[p.name] = self.restarts.get(p.name, 0) + 1
                restarted.append(p.name)
        if restarted:
            write_state(self.dep)
        return restarted


def gateway_ready(url: str) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(f"{url}/health/ready", timeout=2) as resp:
            return resp.status == 200, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return False, exc.read().decode(errors="replace")
    except Exception as exc:
        return False, str(exc)


def workers_short(dep: Deployment, ready_body: str) -> list[str]:
    """The started worker stages the gateway's /health/ready body does not yet count in full,
    as ``"decode 1/2"`` (all of them when the body is not the expected JSON). The gateway can
    serve before every worker is live (conditional routing needs no prefill worker), but a
    deployment reported ready with a worker still loading routes and balances differently
    from the one asked for."""
    wanted = {s: dep.replicas.get(s, 1) for s in WORKER_STAGES if dep.replicas.get(s, 1) > 0}
    try:
        workers = json.loads(ready_body).get("workers")
    except (ValueError, AttributeError):
        workers = None
    if not isinstance(workers, dict):
        workers = {}
    short = []
    for stage, n in wanted.items():
        live = workers.get(stage, 0)
        if not isinstance(live, int) or live < n:
            short.append(f"{stage} {live if isinstance(live, int) else 0}/{n}")
    return short


def wait_ready(dep: Deployment, timeout_s: float) -> None:
    """Wait until the gateway is ready and sees every started worker live; raises SystemExit
    (after stopping everything) when a process exits while starting or after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < end:
        for p in dep.procs:
            if p.popen.poll() is not None:
                tail = p.log_path.read_text(errors="replace")[-3000:]
                stop_all(dep)
                raise SystemExit(f"pdserve: {p.name} exited with {p.popen.returncode} while starting:\n{tail}")
        ok, last = gateway_ready(dep.url)
        if ok:
            short = workers_short(dep, last)
            if not short:
                return
            last = "gateway ready, workers not all live yet: " + ", ".join(short)
        time.sleep(0.3)
    stop_all(dep)
    raise SystemExit(f"pdserve: not ready after {timeout_s:.0f}s: {last}")


def stop_pids(pids: list[int], timeout_s: float = 20.0) -> None:
    """SIGTERM processes that are not our children, then SIGKILL what is left after
    ``timeout_s``."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def stop_all(dep: Deployment) -> None:
    """Stop the services, then NATS/Redis we started.

    The gateways go first and alone: they stop admitting and drain their open streams
    (``PD_SHUTDOWN_DRAIN_S``) while the pipeline behind them still runs; then every other
    stage, each of which drains what it holds.
    """
    gateways = [p.popen for p in dep.procs if p.name.rsplit("-", 1)[0] == "gateway"]
    terminate(gateways, timeout_s=dep.settings.shutdown_drain_s + 10)
    terminate([p.popen for p in dep.procs if p.popen not in gateways])
    terminate([p for p in (dep.nats_proc, dep.redis_proc) if p is not None], timeout_s=5)
    if dep.nats_cluster is not None:
        dep.nats_cluster.stop()


def state_file(state_dir: Path) -> Path:
    return state_dir / "state.json"


def pin_model_workers(replicas: dict[str, int]) -> dict[str, str]:
    """One CPU per prefill/decode replica, round-robin over the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    names = [f"{stage}-{i}" for stage in MODEL_STAGES for i in range(replicas.get(stage, 0))]
    return {name: str(cpus[k % len(cpus)]) for k, name in enumerate(names)}


def up(settings: Settings, replicas: dict[str, int], state_dir: Path, ready_timeout_s: float,
       quiet: bool = False, affinity: dict[str, str] | None = None, nats_nodes: int = 1) -> Deployment:
    """Start a deployment; returns once the gateway is ready and sees every started worker
    (or raises SystemExit). With
    ``nats_nodes`` > 1 and no NATS at PD_NATS_URL, a local cluster of that many nodes."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "logs").mkdir(exist_ok=True)
    existing = state_file(state_dir)
    if existing.exists():
        state = json.loads(existing.read_text())
        if any(_alive(pid) for pid in [*state.get("pids", []), state.get("launcher_pid") or 0] if pid):
            raise SystemExit(f"pdserve: already running (see {existing}); run 'pdserve down' first")
    dep = Deployment(settings=settings, state_dir=state_dir, replicas=replicas, quiet=quiet, affinity=affinity or {},
                     nats_nodes=nats_nodes)
    from engine.model.loader import ensure_model, resolve_device
    from shared.model_files import ModelNotAvailable

    try:  # PD_DEVICE=cuda without a GPU: refuse here, not in every model worker after the model loads
        resolve_device(settings.device)
    except ModelNotAvailable as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    folder = ensure_model(settings, progress=not quiet)
    dep.say(f"model {folder}")
    prepare_kernels(dep)
    ensure_nats(dep)
    ensure_redis(dep)
    start_services(dep)
    write_state(dep)
    wait_ready(dep, ready_timeout_s)
    return dep


def prepare_kernels(dep: Deployment) -> None:
    """Build the C++ kernels once, here, rather than in every worker at start (the first start
    on a machine compiles each for its CPU; later starts find them in the cache): paged
    attention, then, when GGUF blocks are served (``PD_WEIGHTS`` not float), the block linear
    and the fused decode layer. A kernel that does not build is said, and the workers fall back
    (attention to the PyTorch reference; blocks to the de-quantized path)."""
    if dep.settings.attention_backend == "reference" or dep.settings.device == "cuda":
        return
    from kernels import cpu
    from kernels.cpu import quant

    builds = [("attention", cpu.load)]
    if dep.settings.weights != "float" and quant.available():
        builds += [("quantized linear", quant.load), ("fused decode", quant.load_fused)]
    for name, load in builds:
        started = time.monotonic()
        try:
            load()
        except Exception as exc:
            if name == "attention" and dep.settings.attention_backend == "cpu":
                raise SystemExit(f"pdserve: PD_ATTENTION_BACKEND=cpu but the C++ kernel does not build: {exc}") from None
            dep.say(f"the C++ {name} kernel does not build here ({str(exc)[:200]}); the workers do without it")
            continue
        if time.monotonic() - started > 2:
            dep.say(f"built the C++ {name} kernel in {time.monotonic() - started:.0f}s (cached for later starts)")


def write_state(dep: Deployment) -> None:
    """``state.json``: the supervising launcher's pid, the services' and infra pids, the URL."""
    state_file(dep.state_dir).write_text(json.dumps({
        "launcher_pid": os.getpid(),
        "pids": [p.popen.pid for p in dep.procs],
        "infra_pids": [p.pid for p in (dep.nats_proc, dep.redis_proc, *getattr(dep.nats_cluster, "procs", [])) if p is not None],
        "url": dep.url,
        "updated_at": time.time(),
    }))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except (ProcessLookupError, PermissionError, OSError):
        return False


def run_foreground(dep: Deployment) -> int:
    """Supervise until SIGINT/SIGTERM (restarting services that die), then stop everything."""
    stop = {"flag": False}

    def handler(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    supervisor = Supervisor(dep)
    try:
        while not stop["flag"]:
            supervisor.poll()
            time.sleep(0.25)
    finally:
        dep.say("stopping")
        stop_all(dep)
        state_file(dep.state_dir).unlink(missing_ok=True)
        dep.say("stopped")
    return 0


def detach(run_up, state_dir: Path, ready_timeout_s: float) -> str:
    """Run ``run_up()`` (start + supervise) in a daemon process; return its URL once ready.

    The daemon is this process forked before anything heavy runs: it starts the services as
    its own children, supervises them, and stops them on SIGTERM (``pdserve down``).

    Raises:
        SystemExit: the daemon failed to start the deployment.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "logs").mkdir(exist_ok=True)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(read_fd)
        os.setsid()
        log = os.open(state_dir / "logs" / "launcher.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        code = 1
        try:
            dep = run_up()
            os.write(write_fd, f"ready {dep.url}\n".encode())
            os.close(write_fd)
            code = run_foreground(dep)
        except SystemExit as exc:
            os.write(write_fd, f"failed {exc}\n".encode())
        except BaseException as exc:  # report anything to the waiting parent
            os.write(write_fd, f"failed {exc!r}\n".encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    buf = b""
    end = time.monotonic() + ready_timeout_s + 30
    with os.fdopen(read_fd, "rb") as pipe:
        while time.monotonic() < end:
            chunk = pipe.read(4096)
            if not chunk:
                break
            buf += chunk
            if buf.endswith(b"\n"):
                break
    message = buf.decode(errors="replace").strip()
    if message.startswith("ready "):
        return message[len("ready "):]
    reason = message.removeprefix("failed ").removeprefix("pdserve: ") or "no answer"
    raise SystemExit(f"pdserve: could not start in the background: {reason}\n(details: "
                     f"{state_dir / 'logs' / 'launcher.log'} and the service logs beside it)")


def down(state_dir: Path) -> bool:
    """Stop a detached deployment: its supervising launcher stops the services; whatever is
    left after that is stopped directly. False when none was running."""
    path = state_file(state_dir)
    if not path.exists():
        return False
    state = json.loads(path.read_text())
    launcher = state.get("launcher_pid")
    if launcher and launcher != os.getpid() and _alive(launcher):
        stop_pids([launcher], timeout_s=60)
    stop_pids([p for p in state.get("pids", []) if _alive(p)])
    stop_pids([p for p in state.get("infra_pids", []) if _alive(p)], timeout_s=5)
    path.unlink(missing_ok=True)
    return True
