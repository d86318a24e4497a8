"""Speculative decoding (engine/speculative.py) on the tiny model: tokens and logprobs bit-identical
with and without it, KV blocks and the prefix cache exactly as without it, and the rules of
when not to speculate.

The tiny model's random weights rarely repeat themselves, so most tests draft with an *oracle*:
the tokens the request produces without speculation (from a first run), with some drafts
deliberately wrong — verification then accepts long runs, rejects at known places, and rolls
back what it rejected. The n-gram proposer is tested on its own and end to end on SmolLM2
(tests/e2e/test_smollm2_speculative.py).
"""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.quant import effective_block_dot
from engine.speculative import NgramProposer, SpeculativeConfig, Speculator, num_accepted
from shared.messages import SamplingParams
from shared.structured import schema_grammar

BLOCK_SIZE = 4
pytestmark = pytest.mark.timeout(1200)  # the first test builds the kernels when the cache has none


@pytest.fixture(scope="module", params=["Q4_1", "float"])
def model(request, tiny_model_dir):
    """The tiny model in bfloat16 (PD_DTYPE=auto on an AVX512-BF16 CPU) with GGUF-style Q4_1 blocks
    (the default model's storage: the fused per-row path) and with float weights (the unfused
    batch-invariant path)."""
    from transformers import AutoModelForCausalLM

    from engine.model.weights import quantize_float
    from engine.model_runner import ATTN_IMPLEMENTATION, register_attention

    register_attention()
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16,
                                             attn_implementation=ATTN_IMPLEMENTATION).eval()
    if request.param != "float":
        quantize_float(m, request.param)
    return m


def make_engine(model, spec: SpeculativeConfig | None = None, tokenizer_dir=None, **overrides) -> LLMEngine:
    dot = effective_block_dot("auto", torch.bfloat16)  # what PD_BLOCK_DOT=auto picks here
    cfg = dict(model_id="tiny", block_size=BLOCK_SIZE, max_num_seqs=16, max_num_batched_tokens=512,
               num_kv_blocks=512, block_dot=dot, speculative=spec or SpeculativeConfig())
    cfg.update(overrides)
    engine = LLMEngine(copy.deepcopy(model), EngineConfig(**cfg), eos_token_ids=())
    if tokenizer_dir is not None:
        engine.grammar.folder = tokenizer_dir
    return engine


#: drafts in every step (a row cost near zero makes every draft worth its row): the exactness tests
#: need verification to happen, whatever the expected-gain rule would decide
ON = SpeculativeConfig(method="ngram", num_tokens=4, row_cost=0.01)


class Oracle:
    """Drafts the reference output's next tokens, every ``wrong_every``-th draft token replaced by
    a wrong one (so verification rejects there)."""

    def __init__(self, reference: dict[str, list[int]], wrong_every: int, seed: int = 0):
        self.reference = reference
        self.wrong_every = wrong_every
        self.rng = random.Random(seed)
        self.num_proposed = 0

    def install(self, engine: LLMEngine, ids: dict[str, str]) -> None:
        speculator = engine.speculator

        def propose(token_ids, num_draft):
            seq = next(s for s in engine.scheduler.running if s.token_ids is token_ids)
            ref = self.reference[ids[seq.request_id]]
            draft = list(ref[seq.num_output_tokens: seq.num_output_tokens + num_draft])
            for i in range(len(draft)):
                self.num_proposed += 1
                if self.wrong_every and self.num_proposed % self.wrong_every == 0:
                    draft[i] = (draft[i] + 1 + self.rng.randrange(50)) % engine.model.config.vocab_size
            return draft

        speculator.proposer.propose = propose


def run(engine: LLMEngine, prompts, params, check_blocks=True):
    """Generate; after every step, check each running sequence holds exactly the blocks its computed
    tokens fill (rolled back drafts included). Returns the sequences in prompt order."""
    seqs = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while engine.has_unfinished():
        engine.step()
        if check_blocks:
            for seq in engine.scheduler.running:
                if seq.num_computed_tokens >= seq.num_prompt_tokens:
                    assert len(seq.block_table) == -(-seq.num_computed_tokens // BLOCK_SIZE), seq.request_id
    return seqs


def outputs(seqs):
    return [(s.output_token_ids, s.output_logprobs, s.finish_reason) for s in seqs]


PROMPTS = [list(range(10, 26)), [5, 6, 7, 8, 9, 5, 6, 7], list(range(40, 47)), [3, 4, 3, 4, 3, 4, 3]]
PARAMS = [
    SamplingParams(max_tokens=37, temperature=0.0, logprobs=3),
    SamplingParams(max_tokens=40, temperature=0.8, seed=7, logprobs=5),
    SamplingParams(max_tokens=29, temperature=1.0, seed=3, top_p=0.9, repetition_penalty=1.2,
                   frequency_penalty=0.3, logprobs=0),
    SamplingParams(max_tokens=25, temperature=0.6, seed=11, top_k=20, stop_token_ids=(7,)),
]


def reference(model, prompts=PROMPTS, params=PARAMS, **kw):
    engine = make_engine(model, **kw)
    return engine, outputs(run(engine, prompts, params))


@pytest.mark.parametrize("wrong_every", [0, 3, 7])
def test_tokens_and_logprobs_identical_with_and_without_speculation(model, wrong_every):
    base_engine, base = reference(model)
    ref = {f"r{i}": out[0] for i, out in enumerate(base)}
    engine = make_engine(model, ON)
    assert engine.speculator is not None
    oracle = Oracle(ref, wrong_every)
    oracle.install(engine, {k: k for k in ref})
    got = outputs(run(engine, PROMPTS, PARAMS))
    assert got == base  # tokens, logprobs (chosen and top-k) and finish reasons, bit for bit
    stats = engine.stats
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens > 0
    if wrong_every == 0:
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # all right drafts are accepted
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_steps < base_engine.stats.num_steps  # several tokens per step
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_prefix_cache_holds_the_same_blocks_with_the_same_kv(model):
    """Rejected drafts' KV never enters the prefix cache: after the same requests, the cached
    hashes are those of the run without speculation, and each cached block's KV is bit-identical."""
    base_engine, base = reference(model)
    engine = make_engine(model, ON)
    Oracle({f"r{i}": out[0] for i, out in enumerate(base)}, wrong_every=2).install(engine, {f"r{i}": f"r{i}" for i in range(4)})
    run(engine, PROMPTS, PARAMS)
    a, b = base_engine.block_manager.cached_blocks, engine.block_manager.cached_blocks
    assert set(a) == set(b) and len(a) > 20
    for h in a:
        ka, va = base_engine.kv_cache.layer(0)
        kb, vb = engine.kv_cache.layer(0)
        assert torch.equal(ka[a[h].block_id], kb[b[h].block_id]) and torch.equal(va[a[h].block_id], vb[b[h].block_id])


def test_preemption_with_a_small_pool_gives_the_same_tokens(model):
    """A pool too small for every sequence at once: sequences are preempted and recomputed, and
    drafts are dropped when there is no room for them."""
    prompts = PROMPTS * 2
    params = PARAMS * 2
    base_engine, base = reference(model, prompts, params, num_kv_blocks=40)
    assert base_engine.scheduler.num_preemptions > 0
    engine = make_engine(model, ON, num_kv_blocks=40)
    Oracle({f"r{i}": out[0] for i, out in enumerate(base)}, wrong_every=5).install(engine, {f"r{i}": f"r{i}" for i in range(8)})
    assert outputs(run(engine, prompts, params)) == base
    assert engine.scheduler.num_preemptions > 0 and engine.stats.num_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_max_tokens_and_stop_tokens_inside_an_accepted_run(model):
    """A request whose last allowed token (or a stop token) falls inside a run of accepted drafts
    ends exactly there."""
    prompts = [PROMPTS[0]] * 3
    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=1) for n in (1, 2, 6)]
    _, base = reference(model, prompts, params)
    stop_at = base[2][0][3]
    prompts.append(PROMPTS[0])
    params.append(SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(stop_at,)))
    _, base = reference(model, prompts, params)
    assert base[3][2] == "stop" and len(base[3][0]) <= 4
    engine = make_engine(model, SpeculativeConfig(method="ngram", num_tokens=8, row_cost=0.01))
    Oracle({f"r{i}": out[0] + [1] * 10 for i, out in enumerate(base)}, wrong_every=0).install(engine, {f"r{i}": f"r{i}" for i in range(4)})
    assert outputs(run(engine, prompts, params)) == base


def test_grammar_masks_apply_at_every_draft_position(model, tiny_model_dir, tiny_model):
    tok = tiny_model[2]
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}}}
    grammar = schema_grammar(schema, "response_format")
    prompt = tok.encode("Hello world")
    params = [SamplingParams(max_tokens=60, temperature=0.0, grammar=grammar, logprobs=2),
              SamplingParams(max_tokens=60, temperature=1.0, seed=5, grammar=grammar, logprobs=2)]
    base_engine = make_engine(model, tokenizer_dir=tiny_model_dir)
    base = outputs(run(base_engine, [prompt] * 2, params))
    for out in base:
        jsonschema.validate(json.loads(tok.decode(out[0], skip_special_tokens=True)), schema)
    engine = make_engine(model, ON, tokenizer_dir=tiny_model_dir)
    Oracle({f"r{i}": out[0] for i, out in enumerate(base)}, wrong_every=4).install(engine, {"r0": "r0", "r1": "r1"})
    assert outputs(run(engine, [prompt] * 2, params)) == base
    assert engine.stats.num_accepted_tokens > 10


def test_opt_out_and_batch_limit_draft_nothing(model):
    engine = make_engine(model, SpeculativeConfig(method="ngram", max_batch=2, row_cost=0.01))
    ref = {f"r{i}": [0] * 50 for i in range(4)}
    Oracle(ref, 0).install(engine, {k: k for k in ref})
    same_length = [SamplingParams(max_tokens=20, temperature=0.0)] * 4
    run(engine, PROMPTS, same_length)  # four decoding at once until they all end, above max_batch: no drafts
    assert engine.stats.num_draft_tokens == 0
    engine = make_engine(model, ON)
    Oracle(ref, 0).install(engine, {k: k for k in ref})
    params = [SamplingParams(max_tokens=10, temperature=0.0, speculative=False)]
    run(engine, PROMPTS[:1], params)
    assert engine.stats.num_draft_tokens == 0


def test_speculation_stays_off_without_the_batch_invariant_path(model):
    assert make_engine(model, ON, batch_invariant=False).speculator is None


def _with_history(hits: float, misses: float, speculative: bool = True):
    from engine.sequence import Sequence

    seq = Sequence("a", list(range(10)), 5, SamplingParams(max_tokens=100, speculative=speculative), BLOCK_SIZE)
    seq.spec_hits, seq.spec_misses = hits, misses
    return seq


def test_the_plan_maximizes_expected_tokens_per_step_time():
    """Speculator.plan against every choice of draft lengths (brute force): the plan's expected tokens
    per unit of step time, 1 + c * rows, is the best there is, for mixed histories and batches."""
    import itertools

    for c in (0.05, 0.25, 0.6):
        spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=3, row_cost=c), max_model_len=1000)
        for hist in [(0, 0), (20, 0), (3, 4), (0, 9)], [(9, 1), (9, 1)], [(40, 0)], [(1, 0), (30, 1), (0, 3)]:
            seqs = [_with_history(h, m) for h, m in hist]
            p = [spec.acceptance(s) for s in seqs]

            def ratio(lengths, p=p, c=c):
                tokens = sum(1 + sum(pi ** k for k in range(1, d + 1)) for pi, d in zip(p, lengths))
                return tokens / (1 + c * (len(lengths) + sum(lengths)))

            best = max(ratio(ls) for ls in itertools.product(range(4), repeat=len(seqs)))
            assert ratio(spec.plan(seqs)) == pytest.approx(best, rel=1e-12), (c, hist)


def test_drafts_follow_acceptance_and_batch_size():
    """More drafts for a sequence that has been accepted, fewer in a larger batch, none for one whose
    drafts keep failing or that opted out; a failing history fades while the sequence decodes
    without drafts, so it tries again."""
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=8, row_cost=0.25), max_model_len=1000)
    fresh = spec.plan([_with_history(0, 0)])[0]
    assert 1 <= fresh < 8
    copying = _with_history(0, 0)
    for _ in range(6):
        spec.record(copying, 8, 8)
    assert spec.plan([copying])[0] == 8 > spec.plan([copying] * 32)[0] >= 1
    assert spec.plan([_with_history(0, 0)] * 32) == [0] * 32  # a prior of 2/3 does not pay at 32
    failing = _with_history(0, 0)
    for _ in range(4):
        spec.record(failing, 2, 0)
    assert spec.plan([failing]) == [0]
    spec.proposer.propose = lambda token_ids, n: [1] * n
    for _ in range(200):  # decoding without drafts: the history fades, the prior wins again
        failing.num_computed_tokens = failing.num_tokens - 1
        if spec.propose([failing]):
            break
    else:
        raise AssertionError("a failing sequence never drafted again")
    assert spec.plan([_with_history(50, 0, speculative=False)]) == [0]


def test_the_plan_weighs_only_drafts_that_exist():
    """Neighbours whose lookup finds nothing (or that are at max_tokens) take no share of the step's
    drafting: a copying sequence beside them drafts what it would if they had no history at all."""
    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=8, row_cost=0.25), max_model_len=1000)
    copying, lost, done = _with_history(10, 1), _with_history(0, 0), _with_history(0, 0)  # p = 0.89
    done.sampling = SamplingParams(max_tokens=done.num_output_tokens + 1)  # only the pick is left
    for seq in (copying, lost, done):
        seq.num_computed_tokens = seq.num_tokens - 1
    spec.proposer.propose = lambda token_ids, n: [1] * n if token_ids is copying.token_ids else []
    spec.propose([copying, lost, done])
    alone = spec.plan([copying, lost, done], [8, 0, 0])[0]
    assert len(copying.draft_token_ids) == alone > spec.plan([copying, lost, done])[0]
    assert lost.draft_token_ids == [] and done.draft_token_ids == []


def test_ngram_proposer():
    p = NgramProposer(2, 3)
    # the last 3 tokens (7, 8, 9) occurred at 1..3; the draft is what followed them
    assert p.propose([1, 7, 8, 9, 4, 5, 6, 2, 7, 8, 9], 3) == [4, 5, 6]
    assert p.propose([1, 7, 8, 9, 4, 5, 6, 2, 7, 8, 9], 1) == [4]
    # the most recent match wins; a 2-gram when no 3-gram matches
    assert p.propose([8, 9, 1, 2, 0, 8, 9, 3, 5, 8, 9], 2) == [3, 5]
    assert p.propose([1, 2, 3, 4], 4) == []  # no repeat
    assert p.propose([1, 2, 1, 2], 4) == [1, 2]  # stops at the end of the sequence
    assert num_accepted([1, 2, 3], [1, 2, 4, 9]) == 2
    assert num_accepted([1, 2, 3], [5, 2, 3, 9]) == 0
    assert num_accepted([1, 2, 3], [1, 2, 3, 9]) == 3


def test_the_request_timeline_shows_acceptance_and_tokens_per_step():
    from types import SimpleNamespace

    from services.gateway.timelines import Timeline
    from shared.messages import SpecStats, TextChunk, decode_as, encode

    chunk = TextChunk(request_id="r", text="x", text_offset=0, num_tokens=30, finish_reason="stop",
                      spec_stats=SpecStats(num_draft_tokens=40, num_accepted_tokens=30, num_tokens=30, num_steps=10))
    stats = decode_as(encode(chunk), TextChunk).spec_stats  # rides the bus
    tl = Timeline("r", [("gateway.received", 1.0)])
    tl.end([SimpleNamespace(index=0, request_id="r-0", marks=[], spec_stats=stats),
            SimpleNamespace(index=1, request_id="r-1", marks=[], spec_stats=None)])
    got = tl.to_dict()["choices"]
    assert got[0]["speculation"] == {"draft_tokens": 40, "accepted_tokens": 30, "acceptance_rate": 0.75,
                                     "tokens_per_step": 3.0}
    assert got[1]["speculation"] is None


# --- the draft-model method ------------------------------------------------------------------

def test_draft_model_gives_the_same_tokens_and_logprobs(model, tiny_model_dir):
    """The tiny model's own float32 folder drafts for its bf16 (or Q4_1) serving: the draft agrees
    with the target often but not always (another dtype and weight storage), and every token and
    logprob is that of plain decoding, greedy and seeded, including under preemption."""
    base_engine, base = reference(model)
    spec = SpeculativeConfig(method="draft", num_tokens=4, row_cost=0.01, draft_model=str(tiny_model_dir))
    engine = make_engine(model, spec)
    assert engine.speculator.draft_model is not None
    assert outputs(run(engine, PROMPTS, PARAMS)) == base
    stats = engine.stats
    assert stats.num_draft_tokens > 30 and stats.num_accepted_tokens > 0
    assert stats.num_steps < base_engine.stats.num_steps  # accepted drafts saved steps
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks
    assert engine.speculator.draft_model.caches == {}  # finished sequences' draft caches are dropped

    prompts, params = PROMPTS * 2, PARAMS * 2
    _, small = reference(model, prompts, params, num_kv_blocks=40)
    engine = make_engine(model, spec, num_kv_blocks=40)
    assert outputs(run(engine, prompts, params)) == small
    assert engine.scheduler.num_preemptions > 0


def test_a_disagreeing_draft_model_changes_nothing(model, tiny_model_dir, tmp_path):
    """Another tiny model (other random weights, the same tokenizer) drafts tokens the target
    rarely picks: the answer is still plain decoding's, and with the default row cost the failing
    drafts stop (far fewer drafts than when every draft is forced to pay)."""
    from tests.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=1)
    _, base = reference(model)
    engine = make_engine(model, SpeculativeConfig(method="draft", num_tokens=4, row_cost=0.01, draft_model=str(other)))
    got = outputs(run(engine, PROMPTS, PARAMS))
    assert got == base
    stats = engine.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < 0.5 * stats.num_draft_tokens
    ruled = make_engine(model, SpeculativeConfig(method="draft", num_tokens=4, draft_model=str(other)))
    assert outputs(run(ruled, PROMPTS, PARAMS)) == base
    assert ruled.stats.num_draft_tokens < 0.5 * stats.num_draft_tokens


def test_draft_cache_cut_back_drafts_as_a_fresh_one(tiny_model_dir):
    """After a rejection the proposer's cache is cut to the tokens kept: its drafts then equal those
    of a proposer that never saw the rejected ones, and it holds exactly the tokens it was fed."""
    from transformers import AutoConfig

    from engine.speculative import DraftModelProposer

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    p, fresh = DraftModelProposer(str(tiny_model_dir), vocab), DraftModelProposer(str(tiny_model_dir), vocab)
    tokens = list(range(30, 50))
    first = p.propose("a", tokens, 5)
    assert len(first) == 5
    assert p.caches["a"][1] == tokens + first[:4]  # the last draft was never fed
    kept = tokens + first[:2] + [(first[2] + 1) % vocab]  # two accepted, then the target's other pick
    again = p.propose("a", kept, 3)
    assert again == fresh.propose("b", kept, 3)
    assert p.caches["a"][1] == kept + again[:2]
    assert p.caches["a"][0].get_seq_length() == len(kept) + 2
    p.forget(["x"])
    assert p.caches == {}


def test_draft_model_refused_when_it_cannot_draft(tmp_path, tiny_model_dir):
    from engine.speculative import DraftModelProposer

    with pytest.raises(ValueError, match="needs a draft model folder"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="not a local model folder"):
        DraftModelProposer(str(tmp_path / "nothing"), 100)
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        DraftModelProposer(str(tiny_model_dir), 12345)
