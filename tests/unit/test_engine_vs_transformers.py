"""Correctness anchor: greedy float32 output is token-identical to transformers' generate,
for mixed prompt lengths, sequences joining mid-batch, chunked prefill, preemption, prefix
cache hits and KV moved through the store."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine, eos_ids_of
from shared.messages import SamplingParams


def reference(ref_model, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """transformers' greedy output ids after ``prompt``. Memoized on the model object (greedy
    generate is deterministic, and the reference model is never changed): the tests of both
    attention backends ask for the same references, which were much of the suite's time."""
    memo = ref_model.__dict__.setdefault("_pd_reference_memo", {})
    key = (tuple(prompt), max_new_tokens, frozenset(eos))
    if key not in memo:
        ids = torch.tensor([prompt])
        # no eos: an id past the vocabulary, which greedy decoding never picks
        eos_ids = sorted(eos) or [ref_model.config.vocab_size + 1]
        with torch.inference_mode():
            out = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
        memo[key] = out[0, len(prompt):].tolist()
    return list(memo[key])


def make_engine(model, **overrides) -> LLMEngine:
    """An engine on its own copy of ``model``: the C++ backend reroutes the linears and norms of
    the model it is given in place, which would make every later engine on the same object run
    C++ kernels whatever its backend."""
    cfg = dict(model_id="tiny", block_size=4, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256,
               attention_backend="reference", batch_invariant=False)  # the kernels as they are, not that mode
    cfg.update(overrides)
    assert not rewired(model), "the shared tiny model was modified in place"
    engine = LLMEngine(copy.deepcopy(model), EngineConfig(**cfg), eos_token_ids=eos_ids_of(model))
    if cfg["attention_backend"] == "reference":
        assert not rewired(engine.model)
    return engine


def rewired(model) -> list[str]:
    """Modules whose forward was replaced on the instance (what the C++ backend does)."""
    return [name for name, m in model.named_modules() if "forward" in vars(m)]


def prompts_of(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu+batch_invariant"])
def test_mixed_batch_matches_generate(tiny_model, backend):
    model, ref, _ = tiny_model
    eos = eos_ids_of(model)
    prompts = prompts_of([1, 3, 7, 16, 33], model.config.vocab_size)
    engine = make_engine(model, attention_backend=backend.split("+")[0], batch_invariant="+" in backend)
    # the parameter decides what runs: C++ linears and norms only on the cpu backend
    assert bool(rewired(engine.model)) == backend.startswith("cpu")
    seqs = engine.generate(prompts, GREEDY)
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == reference(ref, p, 12, eos)
    # every sequence finished and released its blocks (cached ones stay findable)
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_sequences_join_and_leave_mid_batch(tiny_model, backend):
    model, ref, _ = tiny_model
    eos = eos_ids_of(model)
    prompts = prompts_of([5, 9, 2, 20, 11, 6], model.config.vocab_size, seed=1)
    lengths = [3, 12, 7, 5, 10, 1]
    engine = make_engine(model, attention_backend=backend)
    seqs = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:  # a new request every other step
            i, p = pending.pop(0)
            seqs[i] = engine.add_request(f"r{i}", p, SamplingParams(max_tokens=lengths[i], temperature=0.0))
        engine.step()
        steps += 1
    for i, p in enumerate(prompts):
        assert seqs[i].output_token_ids == reference(ref, p, lengths[i], eos), i


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu+batch_invariant"])
def test_chunked_prefill_matches(tiny_model, backend):
    model, ref, _ = tiny_model
    eos = eos_ids_of(model)
    prompts = prompts_of([40, 23, 3], model.config.vocab_size, seed=2)
    engine = make_engine(model, max_num_batched_tokens=8, attention_backend=backend.split("+")[0],
                         batch_invariant="+" in backend)  # every prompt longer than 8 is chunked
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    step_tokens, first_token_step = [], None
    while engine.has_unfinished():
        engine.step()
        step_tokens.append(engine.stats.last_step_tokens)
        if first_token_step is None and seqs[0].output_token_ids:
            first_token_step = len(step_tokens)
    for p, s in zip(prompts, seqs):
        assert s.output_token_ids == reference(ref, p, 12, eos)
    # chunking, not just many steps: no step over the budget, and the 40-token prompt needed
    # at least five steps of at most 8 tokens before its first token
    assert max(step_tokens) <= 8
    assert first_token_step >= 40 // 8


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_preemption_by_recompute_matches(tiny_model, backend):
    model, ref, _ = tiny_model
    prompts = prompts_of([10, 12, 9, 11], model.config.vocab_size, seed=3)
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = make_engine(model, num_kv_blocks=16, attention_backend=backend)  # 64 token slots for 4 × ~27 tokens
    seqs = engine.generate(prompts, sampling)
    assert engine.scheduler.num_preemptions > 0
    for p, s in zip(prompts, seqs):
        ref_out = reference(ref, p, 16, set())
        assert s.output_token_ids == ref_out


@pytest.mark.parametrize("backend", ["reference", "cpu", "cpu+batch_invariant"])
def test_prefix_cache_hit_matches_and_skips_work(tiny_model, backend):
    model, ref, _ = tiny_model
    eos = eos_ids_of(model)
    vocab = model.config.vocab_size
    shared = prompts_of([24], vocab, seed=4)[0]
    a, b = shared + [5, 6, 7], shared + [9, 10]
    engine = make_engine(model, attention_backend=backend.split("+")[0], batch_invariant="+" in backend)
    (sa,) = engine.generate([a], GREEDY)
    before = engine.stats.num_prefill_tokens
    (sb,) = engine.generate([b], GREEDY)
    assert sb.num_cached_tokens == 24  # 6 full blocks of 4
    assert engine.stats.num_prefill_tokens - before == len(b) - 24
    assert sa.output_token_ids == reference(ref, a, 12, eos)
    assert sb.output_token_ids == reference(ref, b, 12, eos)


def test_kv_handoff_between_engines_matches(tiny_model):
    """Prefill on one engine, export the prompt KV, admit it on another: same tokens."""
    model, ref, _ = tiny_model
    eos = eos_ids_of(model)
    prompt = prompts_of([22], model.config.vocab_size, seed=5)[0]
    prefill = make_engine(model)
    decode = make_engine(model)
    prefill.add_request("x", prompt, GREEDY, stop_after_prefill=True)
    (out,) = prefill.step()
    kv = out.prompt_kv
    assert kv is not None and len(kv.blocks) == 5 and kv.num_tail_tokens == 2
    seq = decode.admit_with_kv("x", prompt, out.new_token_ids, GREEDY, kv.block_hashes,
                               [bytes(b) for b in kv.blocks], bytes(kv.tail))
    assert seq.num_computed_tokens == len(prompt)
    while decode.has_unfinished():
        decode.step()
    assert decode.stats.num_prefill_tokens == 0  # nothing recomputed
    assert seq.output_token_ids == reference(ref, prompt, 12, eos)


def test_blocks_handed_out_during_chunked_prefill_complete_the_final_export(tiny_model):
    """A prompt prefilled in chunks of 8 tokens hands its full blocks out as each chunk ends
    (``on_prompt_blocks``); those and the final export's are byte for byte the blocks the same
    engine exports at the end without the callback, and decode from them matches transformers."""
    model, ref, _ = tiny_model
    eos = eos_ids_of(model)
    prompt = prompts_of([30], model.config.vocab_size, seed=11)[0]  # 7 full blocks of 4 and 2 tokens
    whole = make_engine(model, max_prefill_chunk_tokens=8)
    (seq,) = [whole.add_request("x", prompt, GREEDY, stop_after_prefill=True)]
    outs = []
    while not outs:
        outs = whole.step()
    assert seq.num_prefill_chunks == 4 and outs[0].prompt_kv.first_block == 0
    expected = [bytes(b) for b in outs[0].prompt_kv.blocks]
    chunked = make_engine(model, max_prefill_chunk_tokens=8)
    handed: list[tuple[str, int, list, list]] = []
    chunked.on_prompt_blocks = lambda rid, first, hashes, bufs: handed.append((rid, first, hashes, bufs))
    chunked.add_request("x", prompt, GREEDY, stop_after_prefill=True)
    outs = []
    while not outs:
        outs = chunked.step()
    (out,) = outs
    # chunks end at tokens 8, 16, 24 (blocks 2, 4, 6 complete); the last chunk's block goes with the export
    assert [(rid, first, len(bufs)) for rid, first, _, bufs in handed] == [("x", 0, 2), ("x", 2, 2), ("x", 4, 2)]
    kv = out.prompt_kv
    assert kv.first_block == 6 and len(kv.blocks) == 1 and kv.num_tail_tokens == 2
    early = [bytes(b) for *_, bufs in handed for b in bufs]
    assert early + [bytes(b) for b in kv.blocks] == expected
    assert [h for _, _, hashes, _ in handed for h in hashes] == kv.block_hashes[:6]
    decode = make_engine(model)
    seq = decode.admit_with_kv("x", prompt, out.new_token_ids, GREEDY, kv.block_hashes,
                               early + [bytes(b) for b in kv.blocks], bytes(kv.tail))
    assert seq.num_computed_tokens == len(prompt)
    while decode.has_unfinished():
        decode.step()
    assert decode.stats.num_prefill_tokens == 0
    assert seq.output_token_ids == reference(ref, prompt, 12, eos)
    # a request its first token ends (max_tokens 1) has no hand-off: nothing is handed out early
    handed.clear()
    chunked.add_request("one", prompt, SamplingParams(max_tokens=1, temperature=0.0), stop_after_prefill=True)
    while chunked.has_unfinished():
        chunked.step()
    assert handed == []


def test_kv_handoff_with_missing_blocks_recomputes(tiny_model):
    model, ref, _ = tiny_model
    eos = eos_ids_of(model)
    prompt = prompts_of([22], model.config.vocab_size, seed=6)[0]
    prefill, decode = make_engine(model), make_engine(model)
    prefill.add_request("x", prompt, GREEDY, stop_after_prefill=True)
    (out,) = prefill.step()
    kv = out.prompt_kv
    blocks = [bytes(b) for b in kv.blocks]
    blocks[2] = None  # lost from the store
    seq = decode.admit_with_kv("x", prompt, out.new_token_ids, GREEDY, kv.block_hashes, blocks, bytes(kv.tail))
    assert seq.num_computed_tokens == 8
    while decode.has_unfinished():
        decode.step()
    assert decode.stats.num_prefill_tokens == len(prompt) + 1 - 8  # the gap, then the first output token
    assert seq.output_token_ids == reference(ref, prompt, 12, eos)


def test_abort_frees_blocks(tiny_model):
    model, _, _ = tiny_model
    engine = make_engine(model, enable_prefix_caching=False)
    engine.add_request("a", list(range(3, 30)), GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.num_kv_blocks
    assert engine.abort("a")
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    assert not engine.has_unfinished()
    assert not engine.abort("a")


def test_seeded_sampling_is_batch_invariant(tiny_model):
    model, _, _ = tiny_model
    vocab = model.config.vocab_size
    prompt = prompts_of([9], vocab, seed=7)[0]
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    alone = make_engine(model).generate([prompt], sp)[0].output_token_ids
    others = prompts_of([3, 17, 30], vocab, seed=8)
    crowd = make_engine(model).generate([*others, prompt], [SamplingParams(max_tokens=10, temperature=1.0, seed=5)] * 3 + [sp])
    assert crowd[-1].output_token_ids == alone
    different_seed = make_engine(model).generate([prompt], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=99, ignore_eos=True))
    assert different_seed[0].output_token_ids != alone


def test_rejects_context_overflow(tiny_model):
    from shared.errors import ContextLengthExceeded

    model, _, _ = tiny_model
    engine = make_engine(model, max_model_len=32)
    with pytest.raises(ContextLengthExceeded):
        engine.add_request("big", list(range(3, 30)), SamplingParams(max_tokens=10, temperature=0.0))


def test_blocks_imported_from_the_store_are_prefix_hits(tiny_model):
    """A prefix computed by one worker and read back from the KV store saves work on another."""
    model, ref, _ = tiny_model
    eos = eos_ids_of(model)
    prompt = prompts_of([26], model.config.vocab_size, seed=9)[0]
    first, second = make_engine(model), make_engine(model)
    first.add_request("a", prompt, GREEDY, stop_after_prefill=True)
    (out,) = first.step()
    kv = out.prompt_kv
    assert second.import_cached_blocks(kv.block_hashes, [bytes(b) for b in kv.blocks]) == 6
    assert second.block_manager.num_free_blocks == second.num_kv_blocks  # cached, yet free
    assert second.import_cached_blocks(kv.block_hashes, [bytes(b) for b in kv.blocks]) == 0  # already there
    (seq,) = second.generate([prompt + [5]], GREEDY)
    assert seq.num_cached_tokens == 24
    assert second.stats.num_prefill_tokens == len(prompt) + 1 - 24
    assert seq.output_token_ids == reference(ref, prompt + [5], 12, eos)


def test_an_import_keeps_the_prompts_own_hits_and_stops_when_the_pool_is_full(tiny_model):
    """A worker holds a prompt's first 2 blocks and imports the next 7 from the store into a
    pool of 6: the import must not evict the blocks the prompt is about to hit (its own
    leading hits, its earlier imports) to make room; it stops when no block is free, leaving
    a leading run of 6 cached blocks."""
    model, _, _ = tiny_model
    prompt = prompts_of([38], model.config.vocab_size, seed=9)[0]
    first = make_engine(model)
    first.add_request("a", prompt, GREEDY, stop_after_prefill=True)
    (out,) = first.step()
    hashes, blocks = out.prompt_kv.block_hashes, [bytes(b) for b in out.prompt_kv.blocks]
    assert len(hashes) == 9
    second = make_engine(model, num_kv_blocks=6)
    assert second.import_cached_blocks(hashes[:2], blocks[:2]) == 2  # the worker's local hits
    assert second.import_cached_blocks(hashes[2:], blocks[2:], keep=hashes[:2]) == 4
    assert second.cached_block_hashes(hashes) == 6
    assert second.block_manager.num_free_blocks == 6  # cached, yet free
    # released last block first: the next allocation evicts the prompt's last block, not its first
    second.block_manager.release(second.block_manager.allocate_block())
    assert second.cached_block_hashes(hashes) == 5
