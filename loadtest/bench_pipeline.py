"""What does the pipeline itself cost? One request through all five services next to the
same engine called in one process with no bus, in one run.

For each repetition a fresh ~200-word prompt (different first words, so no prefix cache
hit) is answered greedily with exactly ``--max-tokens`` output tokens (EOS ignored):

* in-process: ``LLMEngine`` with the settings the workers use, ``add_request`` then
  ``step()`` until done; TTFT = time until the first token is sampled, ITL = mean time
  between later tokens; once with the torch threads one pipeline worker gets, once with all
  cores;
* pipeline: ``pdserve up`` (tokenizer, prefill, decode, postfilter, gateway as separate
  processes over NATS, KV through the store), then a streamed HTTP request; TTFT = time to
  the first content chunk at the client, ITL = mean gap between content chunks.

It prints medians and the pipeline's overhead in ms and %.
``pdserve bench pipeline [--reps 5] [--max-tokens 64] [--kv-store shm|redis]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from shared.config import Settings

WORDS = (
    "the history of science is the study of the development of science and scientific knowledge including both "
    "the natural and social sciences it covers the methods people used to learn about nature from ancient "
    "astronomy and medicine through the scientific revolution to modern physics chemistry and biology along the "
    "way it examines how ideas spread between cultures how instruments changed what could be measured and how "
    "institutions such as universities academies and journals shaped the questions that researchers chose to ask"
).split()

OPENERS = ["Please", "Kindly", "Now", "Briefly", "Carefully", "Quickly", "Clearly", "Simply", "Gently", "Firmly"]


def make_prompt(rep: int, num_words: int = 200) -> str:
    body = " ".join(WORDS[i % len(WORDS)] for i in range(num_words - 4))
    return f"{OPENERS[rep % len(OPENERS)]} summarise this text: {body}"


def bench_in_process(settings: Settings, prompts: list[str], max_tokens: int, threads: int) -> list[tuple[float, float]]:
    import torch

    from engine.factory import build_engine
    from engine.model.loader import ensure_model
    from shared.messages import SamplingParams
    from shared.model_files import load_tokenizer

    torch.set_num_threads(threads)
    engine = build_engine(settings.replace(torch_threads=threads))
    tok = load_tokenizer(ensure_model(settings))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    warm = tok.apply_chat_template([{"role": "user", "content": "warm up"}], add_generation_prompt=True, tokenize=False)
    engine.generate([tok.encode(warm, add_special_tokens=False)], SamplingParams(max_tokens=4, temperature=0.0))
    for i, prompt in enumerate(prompts):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        t0 = time.perf_counter()
        engine.add_request(f"bench-{i}", ids, sp)
        times = []
        while engine.has_unfinished():
            if engine.step():
                times.append(time.perf_counter())
        ttft = times[0] - t0
        itl = (times[-1] - times[0]) / (len(times) - 1)
        out.append((ttft, itl))
    return out


def bench_pipeline(settings: Settings, prompts: list[str], max_tokens: int, model_name: str) -> list[tuple[float, float]]:
    from services import launcher, local_infra

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        reps = {"tokenizer": 1, "prefill": 1, "decode": 1, "postfilter": 1, "gateway": 1}
        dep = launcher.up(settings, reps, state_dir=Path(tmp), ready_timeout_s=600, quiet=True)
        try:
            with httpx.Client(base_url=dep.url, timeout=300) as client:
                def one(prompt: str, n: int) -> tuple[float, float]:
                    body = {"model": model_name, "messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                            "temperature": 0, "ignore_eos": True, "stream": True}
                    t0 = time.perf_counter()
                    arrivals = []
                    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                        resp.raise_for_status()
                        for line in resp.iter_lines():
                            if line.startswith("data: {"):
                                choice = json.loads(line[6:])["choices"][0]
                                if choice["delta"].get("content"):
                                    arrivals.append(time.perf_counter())
                    return arrivals[0] - t0, (arrivals[-1] - arrivals[0]) / max(1, len(arrivals) - 1)

                one("warm up", 4)
                for prompt in prompts:
                    out.append(one(prompt, max_tokens))
        finally:
            launcher.stop_all(dep)
            local_infra.drop_namespace(settings)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench pipeline")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--words", type=int, default=200)
    p.add_argument("--kv-store", choices=("shm", "redis"), default=None)
    args = p.parse_args(argv or [])
    from engine.model.loader import ensure_model
    from services.launcher import torch_threads
    from shared.model_files import served_model_name

    overrides = {"namespace": f"bench{uuid.uuid4().hex[:6]}", "gateway_port": 8199}
    if args.kv_store:
        overrides["kv_store"] = args.kv_store
    settings = Settings.from_env(**overrides)
    ensure_model(settings)
    prompts = [make_prompt(i, args.words) for i in range(args.reps)]
    worker_threads = torch_threads(settings, {"prefill": 1, "decode": 1})
    import os

    all_threads = len(os.sched_getaffinity(0))
    rows = {
        f"in-process, {worker_threads} thread(s)": bench_in_process(settings, prompts, args.max_tokens, worker_threads),
    }
    if all_threads != worker_threads:
        rows[f"in-process, {all_threads} threads"] = bench_in_process(settings, prompts, args.max_tokens, all_threads)
    rows[f"pipeline (5 processes, KV via {settings.kv_store})"] = bench_pipeline(
        settings, prompts, args.max_tokens, served_model_name(settings))

    from shared.model_files import load_tokenizer

    tok = load_tokenizer(ensure_model(settings))
    chat = tok.apply_chat_template([{"role": "user", "content": prompts[0]}], add_generation_prompt=True, tokenize=False)
    n_prompt = len(tok.encode(chat, add_special_tokens=False))
    print(f"\nmodel {served_model_name(settings)}, prompt ~{args.words} words ({n_prompt} tokens with the chat template), "
          f"{args.max_tokens} output tokens, greedy, median of {args.reps}")
    print(f"{'mode':<42} {'TTFT ms':>9} {'mean ITL ms':>12}")
    med = {}
    for name, vals in rows.items():
        ttft = statistics.median(v[0] for v in vals) * 1e3
        itl = statistics.median(v[1] for v in vals) * 1e3
        med[name] = (ttft, itl)
        print(f"{name:<42} {ttft:>9.1f} {itl:>12.2f}")
    base_name = next(iter(rows))
    pipe_name = list(rows)[-1]
    (bt, bi), (pt, pi) = med[base_name], med[pipe_name]
    print(f"pipeline overhead vs '{base_name}': TTFT {pt - bt:+.1f} ms ({(pt - bt) / bt * 100:+.1f}%), "
          f"ITL {pi - bi:+.2f} ms ({(pi - bi) / bi * 100:+.1f}%)")
    return 0
