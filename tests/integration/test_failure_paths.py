"""The failure paths docs/operations.md promises, each made to happen: the C++ kernel that does
not build, a prompt longer than PD_MAX_PREFILL_CHUNK_TOKENS, a real JetStream backlog over
PD_MAX_QUEUED_TASKS, a KV store that cannot be written under PD_KV_FAILURE_POLICY=fail (work
that exhausts PD_MAX_DELIVER), and SIGTERM at the gateway within PD_SHUTDOWN_DRAIN_S."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from engine.engine import eos_ids_of
from shared.messages import SamplingParams
from tests.conftest import REPO
from tests.integration.test_pipeline import chat_body
from tests.pipeline_fixture import deployment, log_tail
from tests.unit.test_engine_vs_transformers import make_engine, prompts_of, reference

pytestmark = pytest.mark.timeout(600)


# --- the C++ kernel does not build ------------------------------------------------------------

BUILD_FAILS = r"""
import json, sys
import kernels
from engine.factory import build_engine
from services import launcher
from shared.config import Settings
from shared.messages import SamplingParams

out = {}
base = dict(model=sys.argv[1], cache_dir=sys.argv[2], dtype="float32", kv_cache_memory_bytes=8 << 20)
engine = build_engine(Settings.from_env({}, attention_backend="auto", **base))
out["auto_attention"] = engine.runner.attention.__name__
out["auto_rewired"] = [n for n, m in engine.model.named_modules() if "forward" in vars(m)]
out["auto_tokens"] = engine.generate([json.loads(sys.argv[3])], SamplingParams(max_tokens=8, temperature=0.0))[0].output_token_ids
try:
    build_engine(Settings.from_env({}, attention_backend="cpu", **base))
except RuntimeError as exc:
    out["cpu_error"] = str(exc)
try:
    launcher.prepare_kernels(launcher.Deployment(Settings.from_env({}, attention_backend="cpu"), None, {}))
except SystemExit as exc:
    out["up_cpu_error"] = str(exc)
print("RESULT " + json.dumps(out))
"""


def test_cpp_kernel_build_failure_auto_falls_back_cpu_refuses(tiny_model, tiny_model_dir, tmp_path):
    """A real build failure (a compiler that fails, an empty extensions folder), in a process of
    its own: torch's extension loader versions a name per process, so a failed build in this
    one would make the next build here a new version and rebuild it for every later test."""
    model, ref, _ = tiny_model
    prompt = prompts_of([11], model.config.vocab_size, seed=21)[0]
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PD_LOG_JSON": "true"}
    run = subprocess.run([sys.executable, "-c", BUILD_FAILS, str(tiny_model_dir), str(tmp_path / "cache"),
                          json.dumps(prompt)], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # auto: the reference, with a warning, serving correctly
    assert out["auto_attention"] == "kernels.attention" and out["auto_rewired"] == []
    assert "cpu_kernel_unavailable_using_reference" in run.stdout + run.stderr
    assert out["auto_tokens"] == reference(ref, prompt, 8, eos_ids_of(model))
    # cpu: a clear error naming the setting, in the worker and at `pdserve up`
    assert out["cpu_error"].startswith("PD_ATTENTION_BACKEND=cpu but the C++ kernel does not build")
    assert "use PD_ATTENTION_BACKEND=auto or reference" in out["cpu_error"]
    assert out["up_cpu_error"].startswith("pdserve: PD_ATTENTION_BACKEND=cpu but the C++ kernel does not build")


# --- PD_MAX_PREFILL_CHUNK_TOKENS ----------------------------------------------------------------

def test_prompt_longer_than_the_prefill_chunk_cap_is_chunked_beside_short_ones(tiny_model):
    model, ref, _ = tiny_model
    eos = eos_ids_of(model)
    long, short = prompts_of([40, 3], model.config.vocab_size, seed=22)
    # the step budget (64) would take the whole 40-token prompt; the cap allows 8 per step
    engine = make_engine(model, max_num_batched_tokens=64, max_prefill_chunk_tokens=8)
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    a = engine.add_request("long", long, sp)
    b = engine.add_request("short", short, sp)
    computed = []
    while engine.has_unfinished():
        engine.step()
        computed.append(a.num_computed_tokens)
    prefill_steps = [n for n in computed if n <= len(long)]
    # 40 tokens at most 8 a step: five steps before its first token, each taking at most 8
    assert len(prefill_steps) >= 5
    assert all(b - a <= 8 for a, b in zip([0, *prefill_steps], prefill_steps))
    # the short prompt was not held behind the long one: it finished its prefill in step one
    assert b.num_prompt_tokens == 3 and b.output_token_ids
    assert a.output_token_ids == reference(ref, long, 6, eos)
    assert b.output_token_ids == reference(ref, short, 6, eos)


# --- a deployment to break ---------------------------------------------------------------------

MAX_DELIVER = 3
DRAIN_S = 3.0


@pytest.fixture(scope="module")
def fragile(tmp_path_factory, tiny_model_dir, nats_url):
    """One deployment for the paths below: one task at a time in the tokenizer (so a stopped
    tokenizer leaves a real backlog in JetStream), a small queue limit, few deliveries, KV
    failures that fail, a short drain, and a stopped stage tolerated long enough to queue behind."""
    tmp = tmp_path_factory.mktemp("fragile")
    ns = f"t{uuid.uuid4().hex[:10]}"
    with deployment(tmp, str(tiny_model_dir), ns, block_size=4, shm_dir=str(tmp / "shm"), tokenizer_concurrency=1,
                    max_queued_tasks=3, max_deliver=MAX_DELIVER, kv_failure_policy="fail", ack_wait_s=4.0,
                    shutdown_drain_s=DRAIN_S, stage_down_grace_s=120.0) as dep:
        yield dep


def proc(dep, name: str):
    return next(p for p in dep.procs if p.name.startswith(name))


def wait_admitting(dep, timeout_s: float = 60.0) -> None:
    """Until the gateway admits again (the backlog it reads once a second may be left over from
    another test): what a client honouring Retry-After does."""
    end = time.monotonic() + timeout_s
    with httpx.Client(base_url=dep.url, timeout=60) as c:
        while c.post("/v1/chat/completions", json=chat_body("ping", max_tokens=1)).status_code == 429:
            assert time.monotonic() < end, "the gateway kept refusing"
            time.sleep(1.0)


def test_backlog_in_jetstream_over_max_queued_tasks_gets_429_and_loses_nothing(fragile):
    tokenizer = proc(fragile, "tokenizer").popen
    results: list[httpx.Response] = []

    def send(i: int) -> None:
        with httpx.Client(base_url=fragile.url, timeout=120) as c:
            results.append(c.post("/v1/chat/completions", json=chat_body(f"queued request {i}", max_tokens=3)))

    threads = []
    os.kill(tokenizer.pid, signal.SIGSTOP)  # work now waits in the tokenizer's JetStream queue
    try:
        for i in range(30):  # the gateway reads the backlog once a second
            t = threading.Thread(target=send, args=(i,))
            t.start()
            threads.append(t)
            time.sleep(0.4)
            if any(r.status_code == 429 for r in results):
                break
    finally:
        os.kill(tokenizer.pid, signal.SIGCONT)
    for t in threads:
        t.join(120)
    refused = [r for r in results if r.status_code == 429]
    assert refused, "the backlog never reached PD_MAX_QUEUED_TASKS"
    assert refused[0].headers["retry-after"] and "queued" in refused[0].json()["error"]["message"]
    # every request admitted before the limit completes once the tokenizer runs again
    admitted = [r for r in results if r.status_code != 429]
    assert len(admitted) >= fragile.settings.max_queued_tasks
    assert all(r.status_code == 200 for r in admitted), [r.text for r in admitted if r.status_code != 200]


@pytest.fixture
def broken_store(fragile):
    """The shared-memory store's folders replaced by files: every write fails (even as root)."""
    root = next(d for d in (fragile.state_dir.parent / "shm").iterdir() if (d / "blk").is_dir())  # not pdserve-cores-*
    saved = []
    for kind in ("blk", "tail"):
        shutil.rmtree(root / kind)
        (root / kind).write_text("")
        saved.append(root / kind)
    yield
    for path in saved:
        path.unlink()
        path.mkdir()


def test_kv_failure_policy_fail_ends_the_request_after_max_deliver(fragile, broken_store):
    wait_admitting(fragile)
    with httpx.Client(base_url=fragile.url, timeout=120) as c:
        resp = c.post("/v1/chat/completions", json=chat_body(f"no store {uuid.uuid4().hex[:6]}", max_tokens=4))
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "kv_transfer_failed" and "shared-memory KV store" in error["message"]
    rid = resp.headers.get("x-request-id") or error.get("param")
    log = log_tail(fragile, "prefill", chars=200_000).splitlines()
    mine = [json.loads(line) for line in log if line.startswith("{") and (rid is None or rid in line)]
    retries = [e for e in mine if e.get("event") == "task_retry" and "KV store" in e.get("error", "")]
    failed = [e for e in mine if e.get("event") == "task_failed" and "KV store" in e.get("error", "")]
    # delivered PD_MAX_DELIVER times: retried on all but the last, then failed once
    assert len(failed) == 1 and len(retries) == MAX_DELIVER - 1, (len(retries), len(failed))
    assert [e["delivery"] for e in retries] == list(range(1, MAX_DELIVER))


def test_sigterm_drains_open_streams_within_shutdown_drain_s(fragile):
    """Runs last: the gateway is gone afterwards."""
    wait_admitting(fragile)
    decode = proc(fragile, "decode").popen
    gateway = proc(fragile, "gateway").popen
    body = chat_body("drain me", max_tokens=200, ignore_eos=True, stream=True)
    events: list[str] = []
    with httpx.Client(base_url=fragile.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as s:
        assert s.status_code == 200
        lines = s.iter_lines()
        for line in lines:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # streaming
        os.kill(decode.pid, signal.SIGSTOP)  # the stream now stays open until the drain ends it
        try:
            gateway.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # a new request is refused (503 shutting_down, or no listener any more)
            try:
                late = httpx.post(f"{fragile.url}/v1/chat/completions", json=chat_body("late", max_tokens=2), timeout=10)
                assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
            except httpx.TransportError:
                pass
            events = [line[6:] for line in lines if line.startswith("data: ")]
            ended = time.monotonic() - signalled
        finally:
            os.kill(decode.pid, signal.SIGCONT)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down"
    # the drain lasted its setting: not cut short, and ended well before the 30 s stall timeout
    assert DRAIN_S <= ended < fragile.settings.stall_timeout_s, ended
    assert gateway.wait(30) is not None
