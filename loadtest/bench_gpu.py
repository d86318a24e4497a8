"""``pdserve bench gpu``: the GPU path's check, in one run of a few minutes on a lent GPU.

1. the Triton kernel tests and the CUDA KV-transfer tests, compiled on the GPU;
2. decode attention bandwidth (batch 64, context 2048, bf16) against the card's HBM bandwidth;
3. decode step time of the default model with and without CUDA graphs at batch 1/32/128;
4. KV hand-off GB/s through the pinned staging pool (GPU → host and host → GPU);
5. greedy output of the engine (Triton attention, CUDA graphs) against transformers'
   ``generate`` on the GPU, float32, default model.

It prints a table with the issue's targets (#17) and met/missed, and exits 0 when all are
met, 1 when any is missed or failed, 2 when the machine has no usable CUDA GPU (with a
message saying so, before anything else runs).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

#: Spec-sheet HBM bandwidth (GB/s) by a substring of the device name, longest match wins.
HBM_GBPS = {"H200": 4800, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350, "GH200": 4000, "A100-SXM4-80GB": 2039,
            "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10": 600, "RTX 4090": 1008,
            "RTX 3090": 936, "V100": 900}


@dataclass
class Check:
    """One row of the table: ``value`` against ``target`` (met when ``value >= target``)."""

    name: str
    value: float | None
    target: float | None
    unit: str
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.value is not None and self.value >= self.target


def preflight() -> str | None:
    """Why this machine cannot run the check (None when it can)."""
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (f"pdserve bench gpu needs a CUDA GPU: torch {torch.__version__} ({build}) sees no CUDA device. "
                "Run it on a machine with an NVIDIA GPU and a CUDA build of torch.")
    if importlib.util.find_spec("triton") is None:
        return "pdserve bench gpu needs the triton package (a CUDA build of torch installs it)."
    return None


def hbm_gbps(name: str) -> float | None:
    matches = [k for k in HBM_GBPS if k in name]
    return HBM_GBPS[max(matches, key=len)] if matches else None


def _cuda_time(fn: Callable[[], object], iters: int) -> float:
    """Mean seconds of ``fn`` over ``iters`` runs, timed with CUDA events after two warm-ups."""
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def run_kernel_tests() -> Check:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_triton_attention.py",
           "tests/kernels/test_cuda_kv_transfer.py", "tests/unit/test_kv_staging.py"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
    print((proc.stdout + proc.stderr)[-4000:])
    return Check("kernel + transfer tests on the GPU", 1.0 if proc.returncode == 0 else 0.0, 1.0, "pass", tail[0])


def decode_attention_bandwidth(peak: float | None, heads: int, kv_heads: int, head_dim: int) -> Check:
    from kernels import attention as ref
    from kernels import triton as tk

    dev, batch, ctx, bs = torch.device("cuda"), 64, 2048, 16
    blocks = batch * ctx // bs
    k_cache = torch.randn(blocks, bs, kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device=dev).view(batch, ctx // bs)
    lens = torch.full((batch,), ctx, device=dev)
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    out = tk.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    err = (out.float() - ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale).float()).abs().max()
    # timed as a CUDA graph of 10 calls, so host launch overhead does not count as kernel time
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            tk.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    seconds = _cuda_time(graph.replay, 10) / 10
    gbps = 2 * k_cache.numel() * k_cache.element_size() / seconds / 1e9
    target = 0.7 * peak if peak else None
    note = f"{seconds * 1e6:.0f} µs/call, max err vs reference {err.item():.1e}"
    return Check(f"decode attention GB/s ({heads}/{kv_heads} heads, d={head_dim}, b=64, ctx=2048)", gbps, target,
                 "GB/s", note + ("" if peak else "; HBM peak unknown for this card, give --hbm-gbps"))


def model_folder(settings, which: str) -> tuple[Path, str]:
    """The model to measure: ``default`` (the converted default model; needs its wheel or the
    converted cache), ``synthetic`` (:func:`synthetic_model`) or ``auto`` (default when it can
    be had, else synthetic)."""
    import tempfile

    from engine.model.loader import ensure_model

    if which in ("default", "auto"):
        try:
            return ensure_model(settings, progress=False), "default model"
        except Exception as exc:
            if which == "default":
                raise
            print(f"default model unavailable ({type(exc).__name__}: {str(exc)[:120]}); using a synthetic one")
    from engine.model.synthetic import synthetic_model

    return synthetic_model(Path(tempfile.mkdtemp(prefix="pd-bench-gpu-"))), "synthetic SmolLM2-135M shape"


def _engine(settings, folder: Path, cuda_graphs: bool, sizes: tuple[int, ...], dtype: torch.dtype):
    from engine.engine import LLMEngine
    from engine.factory import engine_config

    cfg = engine_config(settings)
    cfg = type(cfg)(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "attention_backend": "triton",
                       "cuda_graphs": cuda_graphs, "cuda_graph_batch_sizes": sizes, "max_num_seqs": max(sizes),
                       "max_num_batched_tokens": 8192, "max_prefill_chunk_tokens": 0})
    return LLMEngine.load(folder, cfg, dtype, torch.device("cuda"))


def decode_step_times(settings, folder: Path, batches=(1, 32, 128), steps=30) -> list[Check]:
    from shared.messages import SamplingParams

    per_mode = {}
    for graphs in (False, True):
        engine = _engine(settings, folder, graphs, tuple(batches), torch.bfloat16)
        times = {}
        for batch in batches:
            params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"b{batch}-{i}-{graphs}", list(range(10, 42)), params)
            while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                                  for s in engine.sequences.values()):
                engine.step()
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            times[batch] = (time.perf_counter() - t0) / steps
            while engine.has_unfinished():
                engine.step()
        per_mode[graphs] = times
        del engine
        torch.cuda.empty_cache()
    checks = []
    for batch in batches:
        eager, graphed = per_mode[False][batch], per_mode[True][batch]
        checks.append(Check(f"decode step speed-up with CUDA graphs, batch {batch}", eager / graphed,
                            2.0 if batch == 1 else None, "x",
                            f"eager {eager * 1e3:.2f} ms, graphs {graphed * 1e3:.2f} ms per step"))
    return checks


def kv_handoff(num_blocks=256) -> list[Check]:
    from engine.kv_cache import PagedKVCache

    cache = PagedKVCache(num_layers=30, num_kv_heads=3, head_dim=64, num_blocks=num_blocks, block_size=16,
                         dtype=torch.bfloat16, device=torch.device("cuda"), model_id="bench")
    cache.kv.normal_()
    ids = list(range(num_blocks))
    nbytes = cache.nbytes
    cache.export_blocks(ids[:8])
    t0 = time.perf_counter()
    blocks = cache.export_blocks(ids)
    export_s = time.perf_counter() - t0
    data = [bytes(b) for b in blocks]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, b in enumerate(data):
        cache.import_block(i, b)
    torch.cuda.synchronize()
    import_s = time.perf_counter() - t0
    note = f"{num_blocks} blocks of SmolLM2's layout in bf16, {nbytes / 2**20:.0f} MiB"
    return [Check("KV hand-off GPU → host (pinned pool)", nbytes / export_s / 1e9, 10.0, "GB/s", note),
            Check("KV hand-off host → GPU (pinned pool)", nbytes / import_s / 1e9, 10.0, "GB/s", note)]


def greedy_equality(settings, folder: Path, label: str, max_new_tokens=32) -> Check:
    from transformers import AutoModelForCausalLM

    from engine.engine import eos_ids_of
    from shared.messages import SamplingParams

    engine = _engine(settings, folder, True, (1, 2, 4, 8), torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    prompts = [list(range(100, 100 + n)) for n in (5, 17, 64, 200)] + [[1, 9690, 198, 2683, 314, 260, 3575, 282]]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    eos = sorted(eos_ids_of(ref)) or [ref.config.vocab_size + 1]
    equal = 0
    for prompt, seq in zip(prompts, seqs):
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        equal += seq.output_token_ids == out[0, len(prompt):].tolist()
    return Check(f"greedy output equal to transformers generate (fp32, {label})", equal / len(prompts), 1.0,
                 "of prompts",
                 f"{equal}/{len(prompts)} prompts, {max_new_tokens} tokens each")


def print_table(checks: list[Check]) -> None:
    print(f"\n{'check':<66} {'value':>12} {'target':>10}  result  note")
    for c in checks:
        value = "-" if c.value is None else f"{c.value:,.2f} {c.unit}"
        target = "-" if c.target is None else f">= {c.target:,.1f}"
        result = {True: "met", False: "MISSED", None: "info"}[c.met]
        print(f"{c.name:<66} {value:>12} {target:>10}  {result:<6}  {c.note}")


def _guarded(name: str, fn: Callable[[], Check | list[Check]]) -> list[Check]:
    try:
        out = fn()
        return out if isinstance(out, list) else [out]
    except Exception as exc:  # one failing part must not hide the others' figures
        return [Check(name, None, 1.0, "", f"FAILED: {type(exc).__name__}: {str(exc)[:200]}")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--hbm-gbps", type=float, default=None, help="the card's HBM bandwidth (default: from its name)")
    p.add_argument("--skip-tests", action="store_true", help="skip running the kernel tests")
    p.add_argument("--model", choices=("auto", "default", "synthetic"), default="auto",
                   help="model for the step-time and greedy checks (default: auto)")
    args = p.parse_args(argv or [])
    why = preflight()
    if why:
        print(why, file=sys.stderr)
        return 2
    from shared.config import Settings

    settings = Settings.from_env()
    name = torch.cuda.get_device_name()
    peak = args.hbm_gbps or hbm_gbps(name)
    print(f"device: {name}, HBM {peak or '?'} GB/s, torch {torch.__version__}, "
          f"triton {importlib.import_module('triton').__version__}")
    checks: list[Check] = []
    if not args.skip_tests:
        checks += _guarded("kernel tests", run_kernel_tests)
    for shape in ((9, 3, 64), (32, 8, 128)):
        checks += _guarded("decode attention bandwidth", lambda s=shape: decode_attention_bandwidth(peak, *s))
    checks += _guarded("KV hand-off", kv_handoff)
    try:
        folder, label = model_folder(settings, args.model)
    except Exception as exc:
        checks.append(Check("model", None, 1.0, "", f"FAILED: {type(exc).__name__}: {str(exc)[:200]}"))
    else:
        checks += _guarded("decode step with/without CUDA graphs", lambda: decode_step_times(settings, folder))
        checks += _guarded("greedy equality", lambda: greedy_equality(settings, folder, label))
    print_table(checks)
    return 0 if all(c.met is not False for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
