"""What constrained decoding costs per decode step: the grammar masks of a batch of JSON-schema
sequences, on the served model's tokenizer (default: SmolLM2's, 49,152 tokens).

Each of ``batch`` sequences follows its own valid JSON document token by token; per step we
time (1) one mask per sequence, one llguidance call each, (2) the whole batch in one
llguidance executor call (rows on its thread pool), (3) what the engine does per step
(engine/grammar.py: ``start_masks`` in its thread, then unpacking and setting the disallowed
logits to -inf), (4) feeding the sampled tokens to the matchers, and for scale (5) one
log-softmax over the same logits (which the sampler already does for logprobs).

    python -m loadtest.experiments.bench_grammar [--tokenizer FOLDER] [--batch 1 32] [--steps 60]

Times are medians over the steps, in milliseconds per step (whole batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.grammar import GrammarBackend, apply_bitmask, unpack_bitmask
from shared.structured import schema_grammar

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                                      "zip": {"type": "string"}},
                                     "required": ["city", "zip"], "additionalProperties": False}}}


def document(i: int) -> str:
    """A valid document for SCHEMA, different per sequence, in the grammar's compact layout."""
    doc = {"name": f"Person number {i} of the benchmark", "age": 20 + i,
           "tags": ["alpha", "beta", f"tag{i}", "a somewhat longer tag"],
           "address": {"city": "Saint-Rémy-de-Provence", "zip": f"{13210 + i}"}}
    return json.dumps(doc, ensure_ascii=False)


def _ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def run(backend: GrammarBackend, hf_tokenizer, batch: int, steps: int) -> dict:
    grammar = schema_grammar(SCHEMA, "response_format")
    docs = [hf_tokenizer.encode(document(i), add_special_tokens=False) for i in range(batch)]
    steps = min(steps, min(len(d) for d in docs))
    words = (backend.vocab_size + 31) // 32
    timings: dict[str, list[float]] = {"per_row_calls": [], "one_batched_call": [], "batched_and_applied": [],
                                       "consume": [], "log_softmax_reference": []}
    matchers = [backend.compile(grammar) for _ in range(batch)]
    logits = torch.randn(batch, backend.vocab_size)
    for step in range(steps):
        t0 = time.perf_counter()
        single = torch.empty((batch, words), dtype=torch.int32)
        for i, m in enumerate(matchers):
            row = single[i]
            m.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
        t1 = time.perf_counter()
        bitmask = torch.empty((batch, words), dtype=torch.int32)
        backend.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                                 words * 4, batch)
        t2 = time.perf_counter()
        job = backend.start_masks(matchers)
        job.apply(logits.clone())
        t3 = time.perf_counter()
        torch.log_softmax(logits, dim=-1)
        timings["log_softmax_reference"].append(time.perf_counter() - t3)
        assert torch.equal(single, bitmask)
        allowed = unpack_bitmask(bitmask, backend.vocab_size)
        for i, doc in enumerate(docs):
            assert bool(allowed[i, doc[step]]), f"the document's token {step} is masked out"
        t4 = time.perf_counter()
        for m, doc in zip(matchers, docs):
            m.consume_token(doc[step])
        t5 = time.perf_counter()
        timings["per_row_calls"].append(t1 - t0)
        timings["one_batched_call"].append(t2 - t1)
        timings["batched_and_applied"].append(t3 - t2)
        timings["consume"].append(t5 - t4)
    apply_bitmask(logits, list(range(batch)), bitmask)
    return {"batch": batch, "steps": steps, **{k: round(_ms(v), 3) for k, v in timings.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve bench grammar", description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="model folder (default: the served model, PD_MODEL or SmolLM2)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=None, help="llguidance executor threads")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    folder = args.tokenizer
    if folder is None:
        from engine.model.loader import ensure_model
        from shared.config import Settings

        folder = ensure_model(Settings.from_env())
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    import llguidance.hf

    backend = GrammarBackend(llguidance.hf.from_tokenizer(hf), mask_threads=args.threads)
    print(json.dumps({"tokenizer": str(folder), "vocab": backend.vocab_size, "torch_threads": torch.get_num_threads()}))
    for b in args.batch:
        print(json.dumps(run(backend, hf, b, args.steps)))
    backend.close()


if __name__ == "__main__":
    main()
