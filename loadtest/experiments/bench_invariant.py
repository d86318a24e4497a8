"""The cost of batch-invariant numerics (``PD_BATCH_INVARIANT``): decode tokens/s at batch 1
and 32 and the prefill time of a 512-token prompt, with the mode off and on, in one run
(interleaved, best of ``--reps``: ratios are what counts on a shared, noisy machine).

``pdserve bench invariant [--reps N] [--steps N] [--context N]`` runs on the configured model,
dtype and weights (``PD_MODEL``, ``PD_DTYPE``, ``PD_WEIGHTS``; default: SmolLM2-135M, auto).
The decision it informs (on by default unless the cost is over 15%) is in docs/decisions.md.
"""

from __future__ import annotations

import argparse
import json

from loadtest.bench_engine import decode_rates, prefill_rates
from shared.config import Settings


def measure(settings: Settings, reps: int, steps: int, context: int, prompt: int = 512,
            say=lambda line: None) -> dict[str, dict]:
    """``{"off": {...}, "on": {...}}`` with ``decode_tok_s_b1``, ``decode_tok_s_b32`` (output
    tokens/s: batch / median step time) and ``prefill_s_512`` (seconds to the first token),
    each the best of ``reps`` interleaved runs."""
    best: dict[str, dict] = {"off": {}, "on": {}}
    for _ in range(reps):
        for mode in ("off", "on"):
            s = settings.replace(batch_invariant=mode == "on")
            step = decode_rates(s, [1, 32], context, steps)
            pre = prefill_rates(s, [prompt])[prompt]
            got = {"decode_tok_s_b1": 1 / step[1], "decode_tok_s_b32": 32 / step[32], f"prefill_s_{prompt}": pre}
            say(f"mode {mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()))
            for k, v in got.items():
                old = best[mode].get(k)
                better = old is None or (v < old if k.startswith("prefill") else v > old)
                best[mode][k] = v if better else old
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench invariant", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="interleaved off/on repetitions (best is kept)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    p.add_argument("--context", type=int, default=64, help="tokens of context of each decoding sequence")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    settings = Settings.from_env()
    res = measure(settings, args.reps, args.steps, args.context,
                  say=(lambda line: None) if args.json else (lambda line: print(line, flush=True)))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"model {settings.model or 'default (SmolLM2-135M-Instruct)'}, dtype {settings.dtype}, weights {settings.weights}, context {args.context}")
    print(f"{'':24}{'off':>10}{'on':>10}{'cost':>9}")
    for key, label in (("decode_tok_s_b1", "decode tok/s, batch 1"), ("decode_tok_s_b32", "decode tok/s, batch 32"),
                       ("prefill_s_512", "prefill 512 tok, s")):
        off, on = res["off"][key], res["on"][key]
        cost = (off / on - 1) if key.startswith("decode") else (on / off - 1)
        print(f"{label:24}{off:10.2f}{on:10.2f}{cost:+9.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
