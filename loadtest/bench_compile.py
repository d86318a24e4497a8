"""torch.compile against the fused C++ decode step, one run (issue 12's "measure which wins").

Times a batch-1 decode step of the default model (or ``PD_MODEL``) four ways, interleaved:

* ``eager``: transformers' Llama layers op by op on the dtype's float weights, a static KV cache;
* ``compiled``: the same forward through ``torch.compile`` (inductor, CPU: its C++/OpenMP code
  generation fuses the small ops; ``dynamic=False``: one graph for the one shape timed here,
  compiled before timing, the compile time printed);
* ``engine, float``: pdserve's engine on the float weights (``PD_WEIGHTS=float``);
* ``engine, fused``: pdserve's engine on the GGUF blocks with the fused C++ step (the default).

The first two isolate what compiling removes (per-op dispatch and Python between small ops);
the last two are what serving runs. ``python -m loadtest.bench_compile [--steps 32] [--context 256]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from shared.config import Settings


def hf_step_times(folder, dtype: torch.dtype, context: int, steps: int, compile_it: bool) -> tuple[list[float], float]:
    """(seconds per decode step for ``steps`` steps at batch 1 after ``context`` tokens of
    prefill, compile seconds) for transformers' forward with a StaticCache, eager or compiled."""
    from transformers import AutoModelForCausalLM, StaticCache

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    cache = StaticCache(config=model.config, max_cache_len=context + steps + 8)
    ids = torch.randint(0, model.config.vocab_size, (1, context))

    def forward(tok, pos):
        return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

    step = torch.compile(forward, dynamic=False) if compile_it else forward
    with torch.inference_mode():
        logits = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(context), use_cache=True).logits
        tok = logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for i in range(2):  # warm-up (the compile, if any)
            tok = step(tok, torch.tensor([context + i]))[:, -1:].argmax(-1)
        warm = time.perf_counter() - start
        times = []
        for i in range(2, steps + 2):
            t = time.perf_counter()
            tok = step(tok, torch.tensor([context + i]))[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t)
    return times, warm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_compile")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--context", type=int, default=256)
    args = p.parse_args(argv)
    from engine.model_loader import ensure_model, resolve_device, resolve_dtype
    from loadtest.bench_engine import decode_rates

    torch.set_num_threads(args.threads)
    settings = Settings.from_env(torch_threads=args.threads)
    folder = ensure_model(settings)
    dtype = resolve_dtype(settings.dtype, resolve_device(settings.device))
    print(f"batch 1, context {args.context}, {args.threads} threads, {str(dtype).removeprefix('torch.')}, "
          f"load average {os.getloadavg()[0]:.2f}")
    rows = {}
    for label, compile_it in (("eager", False), ("compiled", True)):
        times, warm = hf_step_times(folder, dtype, args.context, args.steps, compile_it)
        rows[label] = statistics.median(times)
        print(f"transformers {label:<9} {rows[label] * 1e3:7.2f} ms/step (median of {len(times)}; "
              f"first two steps {warm:.1f} s{', the compile' if compile_it else ''})")
    for label, weights in (("engine, float", "float"), ("engine, fused", "auto")):
        rows[label] = decode_rates(settings.replace(weights=weights), [1], args.context, args.steps)[1]
        print(f"{label:<22} {rows[label] * 1e3:7.2f} ms/step")
    print(f"compile removes {(1 - rows['compiled'] / rows['eager']) * 100:.0f}% of the eager step; "
          f"the fused C++ step is {rows['compiled'] / rows['engine, fused']:.2f}x faster than the compiled one "
          f"(load average {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
