"""``pdserve profile``: measure the simulator's cost profile on this machine and model, with the
engine's own code paths (``LLMEngine.step`` for prefill and decode, ``export_prompt_kv`` +
the KV store's ``put`` for staging, ``get_views`` + ``admit_with_kv`` for loading, JetStream for
the bus hop, the postfilter's ``Detokenizer`` and the tokenizer for the per-token and
per-request CPU), and write a versioned profile file (:class:`~sim.profile.Profile`).

``pdserve profile [--out FILE] [--quick] [--max-prompt N] [--max-batch N] [--no-bus]
[--synthetic SHAPE [--tokenizer FOLDER]] [--name NAME]``

Settings come from ``PD_*`` as for a worker (model, dtype, device, KV pool size,
``PD_TORCH_THREADS`` — default 1 here, as the modes benchmark pins one core per worker).
Every figure is a median of repeats. ``--synthetic llama2-7b`` (a key of
``engine.model.synthetic.SHAPES``) measures that architecture with random weights drawn on the
device (step costs depend on shapes only): how a lent GPU with no model hub is profiled.
On CUDA, time is read after each step's tokens reached the host, so it includes the device work.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.config import Settings
from shared.messages import SamplingParams
from sim.calibrate import table_attention
from sim.profile import Profile, monotone, smooth_prefill


def _median_time(fn, repeats: int) -> float:
    xs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return statistics.median(xs)


class _Bench:
    def __init__(self, engine, vocab: int, rng: random.Random):
        self.engine, self.vocab, self.rng, self.n = engine, vocab, rng, 0

    def prompt(self, n: int) -> list[int]:
        low = min(1000, self.vocab // 4)
        return [self.rng.randrange(low, self.vocab) for _ in range(n)]

    def rid(self) -> str:
        self.n += 1
        return f"p{self.n}"

    def prefill(self, n: int, repeats: int) -> float:
        def one():
            self.engine.add_request(self.rid(), self.prompt(n), SamplingParams(max_tokens=1, ignore_eos=True))
            self.engine.step()
        one()  # warm-up
        return _median_time(one, repeats)

    def chunk_after(self, n: int, context: int, repeats: int) -> float:
        """Median seconds of an ``n``-token prefill chunk after ``context`` tokens of its own
        prompt computed before it: the second step of a ``context + n``-token prompt prefilled
        in chunks of ``context`` (what a prefix-cache hit's new tokens cost too)."""
        sched = self.engine.scheduler
        keep = sched.max_chunk
        sched.max_chunk = context
        try:
            xs = []
            for _ in range(repeats + 1):  # the first is a warm-up
                self.engine.add_request(self.rid(), self.prompt(context + n), SamplingParams(max_tokens=1, ignore_eos=True))
                self.engine.step()
                t = time.perf_counter()
                self.engine.step()
                xs.append(time.perf_counter() - t)
            return statistics.median(xs[1:])
        finally:
            sched.max_chunk = keep

    def decode(self, batch: int, prompt: int, steps: int, temperature: float = 0.0) -> float:
        """Median decode step of ``batch`` running sequences of ``prompt`` tokens, greedy (as
        the load generators ask) unless ``temperature`` is given (seeded sampling)."""
        e = self.engine
        ids = [self.rid() for _ in range(batch)]
        for r in ids:
            e.add_request(r, self.prompt(prompt), SamplingParams(max_tokens=steps + 4, ignore_eos=True,
                                                                 temperature=temperature, seed=1))
        while e.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in e.scheduler.running):
            e.step()
        t = _median_time(e.step, steps)
        for r in ids:
            e.abort(r)
        return t


def _corun_slowdown(bench: _Bench, batch: int, rounds: int = 3) -> float:
    """Decode step time while a matmul-bound process runs on another core, over alone
    (median of alternating rounds). Above 2 it is taken as outside load, not co-running, and
    clamped (a second worker on its own core slows a memory-bound step, it does not stop it)."""
    code = ("import torch,time;torch.set_num_threads(1);a=torch.randn(1024,1024);t=time.time()\n"
            "while time.time()-t<60: a@a")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pre = ["taskset", "-c", str(cpus[-1])] if len(cpus) > 1 else []
    ratios = []
    for _ in range(rounds):
        alone = bench.decode(batch, 32, 6)
        proc = subprocess.Popen(pre + [sys.executable, "-c", code])
        try:
            time.sleep(0.5)
            both = bench.decode(batch, 32, 6)
        finally:
            proc.kill()
            proc.wait()
        ratios.append(both / alone)
    return min(2.0, max(1.0, statistics.median(ratios)))


def _kv_costs(engine, bench: _Bench, settings: Settings, lengths: list[int]) -> dict:
    """Stage (export + put) and load (``get_views`` + admit_with_kv) times by prompt length,
    shm store."""
    from shared.kv.keys import block_key, tail_key
    from shared.kv.shm import ShmKVStore

    stage, load = [], []
    need = 3 * max(lengths) * engine.bytes_per_token
    shm = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need
    with tempfile.TemporaryDirectory(dir="/dev/shm" if shm else None) as root:
        store = ShmKVStore(root)
        for n in lengths:
            rid = bench.rid()
            prompt = bench.prompt(n)
            seq = engine.add_request(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True))
            engine.step()
            t = time.perf_counter()
            kv = engine.export_prompt_kv(seq)
            items = {block_key(h, "x"): b for h, b in zip(kv.block_hashes, kv.blocks)}
            if kv.tail is not None:
                items[tail_key(rid)] = kv.tail
            store.put(items, 60)
            stage.append(time.perf_counter() - t)
            engine.abort(rid)
            engine.block_manager.reset_prefix_cache()
            t = time.perf_counter()
            # as the decode worker reads them (services/decode/worker.py _load_kv): maps of the
            # store's files where it has them, copied once into the pool by the import
            got = store.get_views([block_key(h, "x") for h in kv.block_hashes])
            tail = store.get_views([tail_key(rid)])[0] if kv.tail is not None else None
            engine.admit_with_kv(bench.rid(), prompt, [1], SamplingParams(max_tokens=4, ignore_eos=True),
                                 kv.block_hashes, got, tail)
            load.append(time.perf_counter() - t)
            engine.abort(f"p{bench.n}")
            engine.block_manager.reset_prefix_cache()
            store.clear()
    bpt = engine.bytes_per_token
    return {"stage": _fit([n * bpt for n in lengths], stage), "load": _fit([n * bpt for n in lengths], load),
            "root": os.path.dirname(root)}


def _fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares (intercept ≥ 0, slope ≥ 0) of y on x."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    var = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / var if var else 0.0
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


async def _bus_hop(settings: Settings, n: int) -> float:
    """Median JetStream work-queue hop: publish (awaiting the ack) → a pull consumer has it."""
    import uuid

    from nats.js import api as js_api

    from shared import nats_bus as bus

    nc = await bus.connect(settings, "pdserve-profile", max_reconnect_attempts=0)
    js = nc.jetstream()
    ns = f"prof{uuid.uuid4().hex[:6]}"
    stream = ns.upper()
    await js.add_stream(js_api.StreamConfig(name=stream, subjects=[f"{ns}.work"], storage=js_api.StorageType.MEMORY,
                                            retention=js_api.RetentionPolicy.WORK_QUEUE, max_age=60))
    try:
        sub = await js.pull_subscribe(f"{ns}.work", durable="w", stream=stream)
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            await js.publish(f"{ns}.work", b"x" * 200)
            msgs = await sub.fetch(1, timeout=5)
            await msgs[0].ack()
            lat.append(time.perf_counter() - t)
        return statistics.median(lat)
    finally:
        await js.delete_stream(stream)
        await nc.close()


def _cpu_costs(settings: Settings, folder) -> dict:
    """Tokenizer seconds (fixed, per token) and the postfilter's detokenize + a token message's
    encode/decode + an SSE event's JSON, per token."""
    import json

    from transformers import AutoTokenizer

    from services.postfilter.text import Detokenizer
    from shared import messages

    tok = AutoTokenizer.from_pretrained(folder)
    words = "the quick brown fox jumps over the lazy dog and keeps running " * 200
    short = _median_time(lambda: tok(words[:200])["input_ids"], 20)
    long_ids = tok(words)["input_ids"]
    long = _median_time(lambda: tok(words)["input_ids"], 10)
    per_token = max(0.0, (long - short) / max(1, len(long_ids) - len(tok(words[:200])["input_ids"])))
    ids = long_ids[:400]

    def stream():
        d = Detokenizer(tok.backend_tokenizer)
        for i, t in enumerate(ids):
            text = d.step(t)
            m = messages.decode(messages.encode(messages.TokenChunk(request_id="r", index=i, token_ids=[t])))
            json.dumps({"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": text}],
                        "m": m.index})
    tok_cpu = _median_time(stream, 5) / len(ids)
    return {"tokenize_s": short, "tokenize_s_per_token": per_token, "token_cpu_s": tok_cpu}


def measure(settings: Settings, *, quick: bool = False, max_prompt: int = 2048, max_batch: int = 64,
            bus: bool = True, name: str = "", model_label: str = "", say=print) -> Profile:
    """Measure a :class:`Profile` for ``settings``' model on this machine (see module doc);
    ``model_label`` names the model in the profile (default: its folder)."""
    import torch

    from engine.factory import build_engine
    from engine.model.loader import ensure_model

    folder = ensure_model(settings)
    engine = build_engine(settings.replace(enable_prefix_caching=False, max_prefill_chunk_tokens=0,
                                           max_num_batched_tokens=max(4096, max_prompt),
                                           max_num_seqs=max(settings.max_num_seqs, max_batch)))
    max_prompt = min(max_prompt, engine.max_model_len - 80)
    vocab = engine.model.config.vocab_size
    bench = _Bench(engine, vocab, random.Random(0))
    rep = 2 if quick else 4
    lengths = [n for n in (1, 16, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096) if n <= max_prompt]
    say(f"profile: prefill {lengths} ...")
    prefill_s = [bench.prefill(n, rep) for n in lengths]
    # every batch up to 8: the block kernels change path with the rows of a step (x's rows in
    # registers up to 4, on AVX-512 up to 6; an L1 buffer beyond: kernels/cpu/quant_block.h), a
    # step in cost that interpolation between 4 and 8 smears over 5-7 (on the Zen 4 EPYC a fifth
    # row added 3.4 ms to a 9.6 ms step before rows 5-6 moved into registers: docs/decisions.md,
    # "Zen 4 again: a verify step's fifth and sixth rows in registers")
    batches = [b for b in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 64, 128, 256) if b <= max_batch]
    say(f"profile: decode batches {batches} ...")
    steps = 4 if quick else 8
    decode_s = [bench.decode(b, 16, steps) for b in batches]
    long_ctx = min(512, max_prompt // 2)
    b_ctx = min(8, max_batch)
    ctx_s = bench.decode(b_ctx, long_ctx, steps)
    short_ctx_s = decode_s[batches.index(b_ctx)] if b_ctx in batches else bench.decode(b_ctx, 16, steps)
    decode_ctx = max(0.0, (ctx_s - short_ctx_s) / (b_ctx * (long_ctx - 16)))
    # a chunk's attention to the context before it (chunked prompts, prefix-cache hits): the
    # same chunk after a long and a short context; the difference is the context pairs' cost
    lo, hi = min(128, max_prompt // 8), min(1024, max_prompt - 64)
    ctx_attn = None
    if hi > lo:
        ctx_attn = max(0.0, (bench.chunk_after(64, hi, rep) - bench.chunk_after(64, lo, rep)) / (64 * (hi - lo)))
    fixed = max(0.0, 2 * decode_s[0] - decode_s[1]) if len(decode_s) > 1 else decode_s[0] / 2
    # what a sampled (temperature > 0) row adds to a decode step over a greedy one
    sample_row = max(0.0, (bench.decode(b_ctx, 16, steps, temperature=1.0) - short_ctx_s) / b_ctx)
    say("profile: KV hand-off, CPU costs ...")
    kv = _kv_costs(engine, bench, settings, [n for n in (64, 256, 1024) if n <= max_prompt])
    if (Path(folder) / "tokenizer.json").exists():
        cpu = _cpu_costs(settings, folder)
    else:  # a synthetic model without a tokenizer: these host costs are not measured
        say("profile: no tokenizer in the model folder; tokenizer and per-token CPU costs left at 0")
        cpu = {"tokenize_s": 0.0, "tokenize_s_per_token": 0.0, "token_cpu_s": 0.0}
    hop = asyncio.run(_bus_hop(settings, 20 if quick else 60)) if bus else 0.001
    say("profile: co-run slowdown ...")
    corun = _corun_slowdown(bench, min(8, max_batch)) if (os.cpu_count() or 1) > 1 else 1.0
    raw_prefill_s = [round(x, 6) for x in prefill_s]
    # the fit is monotone; a running max first would carry one slow short point (a GPU's 1-token
    # prefill, 1.7x its 16-token one) to every longer one. Attention inside one prompt: the fit's
    # quadratic term (sim.calibrate.table_attention), so that a step of several prompts (the table at
    # their total less the pairs between them) agrees with the table itself
    attn = table_attention(lengths, prefill_s)
    if attn is None:  # a table too short to fit: a prompt of 2h tokens against two of h
        half = min(512, max_prompt // 2)
        attn = max(0.0, (bench.prefill(2 * half, rep) - 2 * bench.prefill(half, rep)
                         + _interp_at(lengths, prefill_s, 1)) / (half * half))
    prefill_s = smooth_prefill(lengths, prefill_s)
    decode_s = monotone(decode_s)
    return Profile(
        name=name or f"{platform.node()}-{settings.model or 'smollm2'}".replace("/", "_")[:60],
        measured=True, machine=_machine(engine.device), model=model_label or str(folder), dtype=str(engine.dtype).removeprefix("torch."),
        prefill_tokens=lengths, prefill_s=prefill_s, decode_batch=batches, decode_s=decode_s,
        prefill_attn_s=attn, prefill_ctx_attn_s=ctx_attn, decode_ctx_s=decode_ctx, step_fixed_s=fixed,
        kv_bytes_per_token=engine.bytes_per_token,
        kv_stage_fixed_s=kv["stage"][0], kv_stage_s_per_byte=kv["stage"][1],
        kv_load_fixed_s=kv["load"][0], kv_load_s_per_byte=kv["load"][1],
        bus_hop_s=hop, tokenize_s=cpu["tokenize_s"], tokenize_s_per_token=cpu["tokenize_s_per_token"],
        token_cpu_s=cpu["token_cpu_s"], request_cpu_s=cpu["tokenize_s"] + 4 * hop,
        corun_slowdown=corun, host_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1,
        num_kv_blocks=engine.num_kv_blocks, block_size=engine.config.block_size,
        sources={"how": "pdserve profile (sim/measure.py): medians of LLMEngine.step, export_prompt_kv+"
                        "ShmKVStore.put, get_views+admit_with_kv, JetStream publish→pull, Detokenizer+message+SSE JSON",
                 "torch_threads": torch.get_num_threads(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "request_cpu_s": "tokenize + 4 bus hops' worth of CPU (gateway, tokenizer, router): an estimate",
                 "prefill_s": "least-squares a + b n + c n^2 over the measured points (sim.profile.smooth_prefill); "
                              "prefill_attn_s its 2c",
                 "prefill_s_measured": raw_prefill_s,
                 "decode_s": "greedy rows (temperature 0, what the load generators send)",
                 "sample_s_per_row": round(sample_row, 7), "kv_store_root": kv["root"],
                 "device": str(engine.device), "kv_pool_bytes": engine.num_kv_blocks * engine.config.block_size
                 * engine.bytes_per_token},
    )


def _synthetic_settings(settings: Settings, shape: str, tokenizer: str, tmp: str) -> tuple[Settings, str]:
    """``settings`` pointed at a random-weight model of ``shape`` written under ``tmp`` (drawn on
    the settings' device, stored in its dtype), with a tokenizer copied in; and the profile's
    model label."""
    from engine.model.loader import ensure_model, resolve_device, resolve_dtype
    from engine.model.synthetic import synthetic_model

    device = resolve_device(settings.device)
    tok = Path(tokenizer) if tokenizer else None
    if tok is None:
        try:
            tok = ensure_model(settings.replace(model=""), progress=False)
        except Exception:  # no default model here: the tokenizer costs are then left out
            tok = None
    folder = synthetic_model(Path(tmp) / shape, shape, dtype=resolve_dtype(settings.dtype, device), device=device,
                             initializer_range=0.02, tokenizer_from=tok)
    return settings.replace(model=str(folder)), f"{shape} shape, random weights (engine.model.synthetic)"


def _interp_at(xs: list[int], ys: list[float], x: int) -> float:
    import numpy as np

    return float(np.interp(x, xs, ys))


def _machine(device=None) -> str:
    """The host's CPU model and count, and the GPU's name when ``device`` is CUDA."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
                break
    except OSError:
        pass
    if device is not None and getattr(device, "type", "") == "cuda":
        import torch

        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}); host {cpu}"
    return cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="", help="profile file (default profiles/<name>.json)")
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--no-bus", action="store_true", help="skip the NATS hop (default 1 ms)")
    p.add_argument("--synthetic", default="", help="measure this architecture with random weights instead of "
                   "PD_MODEL: smollm2-135m, llama2-7b (engine.model.synthetic.SHAPES)")
    p.add_argument("--tokenizer", default="", help="with --synthetic: a model folder with a tokenizer.json, whose "
                   "tokenizer prices the tokenizer and postfilter (default: the default model's, converted if needed; "
                   "without one those costs are left at 0)")
    p.add_argument("--name", default="", help="the profile's name (default: host-model)")
    args = p.parse_args(argv or [])
    from engine.model.synthetic import SHAPES

    env = dict(os.environ)
    env.setdefault("PD_TORCH_THREADS", "1")
    settings = Settings.from_env(env)
    if args.tokenizer and not args.synthetic:
        p.error("--tokenizer goes with --synthetic (a model folder has its own tokenizer)")
    if args.tokenizer and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        p.error(f"--tokenizer {args.tokenizer}: no tokenizer.json there (a Hugging Face model folder with a fast "
                "tokenizer, e.g. the converted default model's)")
    label = ""
    with tempfile.TemporaryDirectory(prefix="pd-profile-") as tmp:
        if args.synthetic:
            if args.synthetic not in SHAPES:
                p.error(f"--synthetic {args.synthetic!r}: one of {', '.join(SHAPES)}")
            settings, label = _synthetic_settings(settings, args.synthetic, args.tokenizer, tmp)
        prof = measure(settings, quick=args.quick, max_prompt=args.max_prompt, max_batch=args.max_batch,
                       bus=not args.no_bus, name=args.name, model_label=label)
    path = prof.save(args.out or f"profiles/{prof.name}.json")
    print(f"profile: prefill 512 tokens {prof.prefill_s[min(len(prof.prefill_s) - 1, 5)] * 1e3:.0f} ms, decode "
          f"batch 1 {prof.decode_s[0] * 1e3:.1f} ms, hop {prof.bus_hop_s * 1e3:.2f} ms, co-run ×{prof.corun_slowdown:.2f}")
    print(f"profile: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
