"""Speculative decoding (engine/speculative.py) with and without, in one run (issue 31).

``pdserve bench spec [--tokens 160] [--requests 3] [--streams 32] [--crossover]`` builds one engine as
``pdserve up`` does (the default model, dtype and kernels; ``PD_*`` settings apply) and prints, per
workload, the time per output token (TPOT: from a request's first output token to its last,
divided by the tokens in between) and the acceptance rate, with speculation on and off:

* **copy-heavy**: edit requests whose answer reproduces most of a given text, the workload
  prompt lookup was made for (Saxena 2023, "Prompt Lookup Decoding", whose demos are code
  editing and summarisation; the "whole file" edit format of coding assistants such as
  aider, https://aider.chat/docs/more/edit-formats.html, asks for the full edited file back):
  :data:`COPY_HEAVY` — a Python module, a shell script and a paragraph of prose, each with a
  small edit to make and the whole result asked for;
* **random text**: stories about three random words (open-ended output, nothing to copy);
* **32 streams**: both workloads mixed, 32 requests at once (the per-step rule, not per
  sequence, then decides).

Every request is greedy; the run checks that each output is the same token for token with
and without speculation, and says so. With ``--crossover`` it first measures the decode step's
time against its rows (sequences x (1 + drafts)), the measurement behind
``PD_SPECULATIVE_ROW_COST`` (docs/decisions.md): it also prints the fit of ``step = fixed + rows x
per-row`` to each batch's two points and their ratio (the row cost).

The engine is stepped directly (no HTTP, no bus): TPOT here is the engine's own, which is what
speculation changes; the pipeline adds a fixed cost per chunk that speculation divides by the
tokens per step.

``pdserve bench spec --http`` measures what a client sees instead: it starts the README's default
deployment (``pdserve up``'s workers, threads and settings: speculation on), sends the same
workloads as streamed chat completions, each request once as it is and once with
``"speculative": false`` (alternating, so the machine's drift falls on both alike), and prints
the client's TPOT (first content chunk to the end, over the output tokens after the first), the
acceptance and tokens per step from each request's ``/debug/timeline``, and whether every answer
was the same text with and without speculation.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from shared.config import Settings

_MODULE = '''import json
import os
from dataclasses import dataclass


@dataclass
class Account:
    owner: str
    balance: float = 0.0

    def deposit(self, amount: float) -> None:
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount

    def withdraw(self, amount: float) -> None:
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount


def load_accounts(path: str) -> list[Account]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = json.load(f)
    return [Account(row["owner"], row["balance"]) for row in rows]


def save_accounts(path: str, accounts: list[Account]) -> None:
    with open(path, "w") as f:
        json.dump([{"owner": a.owner, "balance": a.balance} for a in accounts], f)
'''

_SCRIPT = '''#!/bin/sh
set -e
SRC_DIR=./src
OUT_DIR=./build
mkdir -p "$OUT_DIR"
for file in "$SRC_DIR"/*.c; do
    name=$(basename "$file" .c)
    echo "compiling $name"
    gcc -O2 -Wall -c "$file" -o "$OUT_DIR/$name.o"
done
gcc "$OUT_DIR"/*.o -o "$OUT_DIR/app"
echo "done: $OUT_DIR/app"
'''

_PROSE = ("The city library opens at nine in the morning and closes at six in the evening. On "
          "weekends it opens at ten and closes at four. Members can borrow up to five books at a time "
          "for three weeks. Books can be renewed online twice, unless another member has reserved them. "
          "Late returns cost ten cents a day per book. The reading room on the second floor is quiet, and "
          "the children's corner on the ground floor has story time every Saturday at eleven.")

#: (instruction, text) pairs: the answer is the text again with a small change.
COPY_HEAVY = [
    ("Rename the class Account to BankAccount everywhere in this Python module. Reply with the whole "
     "updated module and nothing else.", _MODULE),
    ("In this shell script, change the optimisation flag -O2 to -O3. Reply with the whole updated script "
     "and nothing else.", _SCRIPT),
    ("Rewrite this text with the opening time on weekends changed from ten to eleven. Keep everything "
     "else exactly the same. Reply with the whole text.", _PROSE),
]

_WORDS = ("river stone lamp orange music quiet window paper yellow garden machine silver forest winter "
          "glass market thunder pencil ocean candle mirror valley rocket basket violin desert cloud bridge "
          "tiger planet honey ladder castle feather engine jungle marble pepper saddle tunnel velvet").split()


def random_text_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` requests for a story about three random words: open-ended text, nothing given to copy
    (a small model still repeats itself now and then, which prompt lookup can draft)."""
    rng = random.Random(seed)
    return [f"Write a short story about a {rng.choice(_WORDS)}, a {rng.choice(_WORDS)} and a {rng.choice(_WORDS)}."
            for _ in range(n)]


def chat_prompt(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def copy_heavy_prompts(n: int) -> list[str]:
    return [f"{instruction}\n\n{text}" for instruction, text in (COPY_HEAVY * n)[:n]]


def run_requests(engine, prompts: list[list[int]], max_tokens: int, speculate: bool, speculator,
                 concurrent: bool) -> dict:
    """Run ``prompts`` greedily (all at once, or one after another); returns the outputs, the mean
    TPOT (seconds) over requests, and the drafted / accepted counts."""
    from shared.messages import SamplingParams

    engine.speculator = speculator if speculate else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before = (engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens, engine.stats.num_steps)
    tpots, outputs = [], []
    batches = [prompts] if concurrent else [[p] for p in prompts]
    base = f"b{random.getrandbits(24):06x}"
    for b, batch in enumerate(batches):
        seqs = [engine.add_request(f"{base}-{b}-{i}", p, sp) for i, p in enumerate(batch)]
        first, last = {}, {}
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
        for seq in seqs:
            n = seq.num_output_tokens
            if n > 1:
                tpots.append((last[seq.request_id] - first[seq.request_id]) / (n - 1))
            outputs.append(seq.output_token_ids)
    drafted = engine.stats.num_draft_tokens - before[0]
    accepted = engine.stats.num_accepted_tokens - before[1]
    tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "tpot_s": sum(tpots) / len(tpots), "drafted": drafted, "accepted": accepted,
            "tokens_per_step": tokens / max(1, engine.stats.num_steps - before[2])}


def crossover(engine, batches=(1, 2, 4, 8, 16, 32), drafts=(0, 4), context: int = 128) -> None:
    """Median decode step time at each batch size with ``d`` forced (always rejected) drafts per
    sequence: what a step of ``batch x (1 + d)`` rows costs against ``batch`` rows."""
    from shared.messages import SamplingParams

    speculator = engine.speculator
    config = speculator.config
    print("\ncrossover: median step ms by decode batch (rows) and drafts per sequence (forced, rejected)")
    print(f"  {'batch':>5} " + " ".join(f"{'d=' + str(d):>10}" for d in drafts) + f"   ratio d={drafts[-1]}/d=0"
          "   per-row ms  fixed ms  row cost")
    for batch in batches:
        row = []
        for d in drafts:
            engine.speculator = speculator if d else None
            if d:
                speculator.proposer.propose = lambda token_ids, n, d=d: [token_ids[-1] ^ 1] * min(d, n)
                speculator.plan = lambda decoding, caps=None, d=d: [d] * len(decoding)
                # every sequence drafts: no cap, and a row cost that lets any first draft pay
                speculator.config = type(speculator.config)(**{**_fields(speculator.config), "max_batch": 0,
                                                                "row_cost": 1e-9})
            sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            for b in range(batch):
                engine.add_request(f"x{batch}-{d}-{b}", [(7 * b + i) % 40000 + 100 for i in range(context)], sp)
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
                engine.step()
            times = []
            for _ in range(8):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            for rid in list(engine.sequences):
                engine.abort(rid)
            row.append(sorted(times)[len(times) // 2])
        per_row = (row[-1] - row[0]) / (batch * drafts[-1])  # step = fixed + rows x per_row, through both points
        fixed = row[0] - batch * per_row
        print(f"  {batch:>5} " + " ".join(f"{t * 1e3:>10.1f}" for t in row) + f"   {row[-1] / row[0]:>6.2f}"
              f"   {per_row * 1e3:>10.2f}  {fixed * 1e3:>8.2f}  {per_row / fixed if fixed > 0 else float('inf'):>8.2f}")
    from engine.speculative import NgramProposer

    speculator.proposer = NgramProposer(speculator.config.ngram_min, speculator.config.ngram_max)
    speculator.config = config
    del speculator.plan  # the method again
    engine.speculator = speculator


async def _http_rows(url: str, model: str, workloads: dict, many: list[str], max_tokens: int) -> list[tuple]:
    """The HTTP rows: (label, TPOT off s, TPOT on s, acceptance, tokens per step on, same text)."""
    import asyncio

    import httpx

    from loadtest.client import RequestSpec, first_choice_timeline, send_one

    async def one(client, prompt: str, speculate: bool):
        extra = {} if speculate else {"speculative": False}
        r = await send_one(client, model, RequestSpec(0, prompt, max_tokens, chat=True), extra=extra)
        if not r.ok:
            raise RuntimeError(f"request failed: {r.error}")
        choice = await first_choice_timeline(client, r) if speculate else None
        return r, (choice or {}).get("speculation")

    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=128, max_keepalive_connections=64)) as client:
        await one(client, "Say hello.", True)  # warm-up
        groups = [(f"{name}, 1 stream", [[p] for p in prompts]) for name, prompts in workloads.items()]
        groups.append((f"mixed, {len(many)} streams", [many] * 4))  # off/on, on/off, off/on, on/off
        for label, parts in groups:
            got = {False: [], True: []}
            for i, part in enumerate(parts):
                for speculate in ((False, True) if i % 2 == 0 else (True, False)):
                    got[speculate].append(await asyncio.gather(*(one(client, p, speculate) for p in part)))
            tpot = {k: [r.tpot_s for batch in v for r, _ in batch if r.tpot_s is not None] for k, v in got.items()}
            texts = {k: [r.text for batch in v for r, _ in batch] for k, v in got.items()}
            stats = [st for batch in got[True] for _, st in batch if st]
            drafted = sum(st["draft_tokens"] for st in stats)
            accepted = sum(st["accepted_tokens"] for st in stats)
            per_step = [st["tokens_per_step"] for st in stats if st["tokens_per_step"]]
            rows.append((label, sum(tpot[False]) / len(tpot[False]), sum(tpot[True]) / len(tpot[True]),
                         f"{accepted / drafted:.0%}" if drafted else "no drafts",
                         sum(per_step) / len(per_step) if per_step else 1.0, texts[False] == texts[True]))
    return rows


def http_main(args, settings: Settings) -> int:
    """``--http``: the default deployment, each request with and without speculation."""
    import asyncio

    from engine.model.loader import ensure_model
    from loadtest.bench_cores import cpu_line
    from loadtest.bench_modes import Deployed, _model_name

    ensure_model(settings)
    workloads = {"copy-heavy": copy_heavy_prompts(args.requests), "random text": random_text_prompts(args.requests)}
    many = copy_heavy_prompts(args.streams // 2) + random_text_prompts(args.streams - args.streams // 2, seed=1)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"pdserve bench spec --http: {cpu_line()}; the README's default deployment (1 prefill + 1 decode, "
          f"pdserve up's threads, PD_CORE_SHARE={settings.core_share}, method {settings.speculative_method}); "
          f"{args.tokens} tokens a request, greedy; load average {load}")
    with Deployed(settings, {"replicas": {"prefill": 1, "decode": 1}, "affinity": {}, "settings": {}}) as dep:
        rows = asyncio.run(_http_rows(dep.url, _model_name(settings), workloads, many, args.tokens))
    print(f"\n{'workload':<26} {'TPOT off ms':>12} {'TPOT on ms':>11} {'speed-up':>9} {'accepted':>9} "
          f"{'tokens/step on':>15} {'same text':>10}")
    for label, off, on, rate, per_step, same in rows:
        print(f"{label:<26} {off * 1e3:>12.2f} {on * 1e3:>11.2f} {off / on:>8.2f}x {rate:>9} {per_step:>15.2f} "
              f"{str(same):>10}")
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {' '.join(f.read().split()[:3])}")
    return 0


def _merge(results: list[dict]) -> dict:
    """Results of consecutive :func:`run_requests` calls as one (TPOT: the mean over the calls)."""
    return {"outputs": [o for r in results for o in r["outputs"]],
            "tpot_s": sum(r["tpot_s"] for r in results) / len(results),
            "drafted": sum(r["drafted"] for r in results), "accepted": sum(r["accepted"] for r in results),
            "tokens_per_step": sum(r["tokens_per_step"] for r in results) / len(results)}


def _fields(config) -> dict:
    return {name: getattr(config, name) for name in config.__slots__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=160, help="output tokens per request")
    p.add_argument("--requests", type=int, default=3, help="requests per workload at one stream")
    p.add_argument("--streams", type=int, default=32, help="requests at once in the many-streams part")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--crossover", action="store_true", help="measure step time against rows first")
    p.add_argument("--http", action="store_true",
                   help="through the README's default deployment (streamed chat completions) instead of the engine")
    args = p.parse_args(argv or [])
    if args.http:
        return http_main(args, Settings.from_env())
    settings = Settings.from_env(torch_threads=args.threads)
    if settings.speculative_method == "off":
        settings = settings.replace(speculative_method="ngram")
    from transformers import AutoTokenizer

    from engine.factory import build_engine
    from engine.model.loader import ensure_model

    folder = ensure_model(settings)
    engine = build_engine(settings.replace(max_num_seqs=max(args.streams, 8), kv_cache_memory_bytes=1 << 30))
    speculator = engine.speculator
    if speculator is None:
        print("speculation is off in this engine (it needs PD_BATCH_INVARIANT on a CPU)")
        return 1
    tok = AutoTokenizer.from_pretrained(str(folder))
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"pdserve bench spec: {settings.model or 'default model'}, dtype {engine.dtype}, block_dot "
          f"{engine.runner.block_dot}, {args.threads} threads, load average {' '.join(load)}; "
          f"drafts {speculator.config.num_tokens}, n-grams {speculator.config.ngram_min}..{speculator.config.ngram_max}, "
          f"max batch {speculator.config.max_batch or 'none'}, row cost {speculator.config.row_cost}")
    if args.crossover:
        crossover(engine)
    workloads = {
        "copy-heavy": [chat_prompt(tok, t) for t in copy_heavy_prompts(args.requests)],
        "random text": [chat_prompt(tok, t) for t in random_text_prompts(args.requests)],
    }
    many = [chat_prompt(tok, t) for t in copy_heavy_prompts(args.streams // 2)
            + random_text_prompts(args.streams - args.streams // 2, seed=1)]
    # warm-up: the first steps build caches and thread pools
    run_requests(engine, workloads["random text"][:1], 8, True, speculator, False)
    print(f"\n{'workload':<26} {'TPOT off ms':>12} {'TPOT on ms':>11} {'speed-up':>9} {'accepted':>9} "
          f"{'tokens/step on':>15} {'same tokens':>12}")
    rows = [(f"{name}, 1 stream", prompts, False) for name, prompts in workloads.items()]
    rows.append((f"mixed, {args.streams} streams", many, True))
    for label, prompts, concurrent in rows:
        # off and on alternate request by request (batch by batch), so that the machine's load
        # drifts over both alike
        parts = [prompts] * 2 if concurrent else [[p] for p in prompts]
        runs = {False: [], True: []}
        for part in parts:
            for speculate in (False, True):
                runs[speculate].append(run_requests(engine, part, args.tokens, speculate, speculator, concurrent))
        off, on = (_merge(runs[False]), _merge(runs[True]))
        rate = f"{on['accepted'] / on['drafted']:.0%}" if on["drafted"] else "no drafts"
        print(f"{label:<26} {off['tpot_s'] * 1e3:>12.2f} {on['tpot_s'] * 1e3:>11.2f} "
              f"{off['tpot_s'] / on['tpot_s']:>8.2f}x {rate:>9} {on['tokens_per_step']:>15.2f} "
              f"{str(on['outputs'] == off['outputs']):>12}")
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {' '.join(f.read().split()[:3])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
