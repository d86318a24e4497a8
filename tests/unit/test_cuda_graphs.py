"""CUDA-graph decode on CPU: buckets, padding and static buffers, with a stand-in capture that
records the step and re-runs it on replay (what a CUDA graph does, minus the GPU). A replay
reads only the static buffers, so any metadata not copied into them shows up as wrong output."""

from __future__ import annotations

import types

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine, eos_ids_of
from engine.model.cuda_graphs import DecodeGraphs
from kernels import attention as ref
from shared.messages import SamplingParams


class RecordingCapture:
    """Captures by running the step once; replay re-runs it into the captured output."""

    def __init__(self):
        self.captured: list[int] = []

    def __call__(self, step):
        out = step()
        self.captured.append(out.shape[0])
        return (lambda: out.copy_(step())), out


def fake_forward(ids, pos, meta):
    """Logits that expose every input row: id, position, slot, context length, table sum."""
    return torch.stack([ids, pos, meta["slots"], meta["lens"], meta["tables"].sum(1)], dim=1).float()


def make_graphs(sizes=(1, 2, 4, 8), max_blocks=6):
    capture = RecordingCapture()
    graphs = DecodeGraphs(fake_forward, lambda slots, tables, lens: {"slots": slots, "tables": tables, "lens": lens},
                          sizes, max_blocks, torch.device("cpu"), capture)
    graphs.capture_all()
    return graphs, capture


def test_buckets_and_capture_order():
    graphs, capture = make_graphs()
    assert capture.captured == [8, 4, 2, 1]  # largest first: smaller graphs reuse its memory pool
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError):
        DecodeGraphs(fake_forward, dict, [], 4, torch.device("cpu"), capture)


def test_replay_sees_this_steps_metadata_and_pads_the_rest():
    graphs, _ = make_graphs()
    ids, pos = torch.tensor([11, 12, 13]), torch.tensor([5, 9, 30])
    slots, lens = torch.tensor([21, 38, 120]), torch.tensor([6, 10, 31])
    tables = torch.tensor([[5, 0], [9, 3], [30, 2]])
    out = graphs.run(ids, pos, slots, tables, lens)
    expected = torch.stack([ids, pos, slots, lens, tables.sum(1)], dim=1).float()
    assert torch.equal(out, expected) and graphs.num_replays == 1
    # the bucket of 4 ran: its padded row writes nowhere and reads one token of block 0
    assert graphs.slot_mapping[3].item() == -1 and graphs.context_lens[3].item() == 1
    assert not graphs.block_tables[3].any() and graphs.input_ids[3].item() == 0
    # a later, smaller and narrower step leaves nothing of the previous one behind
    out = graphs.run(torch.tensor([7]), torch.tensor([2]), torch.tensor([40]), torch.tensor([[8]]),
                     torch.tensor([3]))
    assert out.tolist() == [[7.0, 2.0, 40.0, 3.0, 8.0]]
    out = graphs.run(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([3, 4]), torch.tensor([[1], [2]]),
                     torch.tensor([1, 1]))
    assert out[:, 4].tolist() == [1.0, 2.0]  # columns 1.. of the earlier wide table were cleared
    assert graphs.slot_mapping[:2].tolist() == [3, 4]


def test_shapes_outside_the_buckets_run_eagerly():
    graphs, _ = make_graphs(sizes=(1, 2), max_blocks=2)
    nine = torch.arange(3)
    assert graphs.run(nine, nine, nine, torch.zeros(3, 1, dtype=torch.long), nine + 1) is None  # batch 3 > 2
    assert graphs.run(nine[:1], nine[:1], nine[:1], torch.zeros(1, 3, dtype=torch.long), nine[:1] + 1) is None
    assert graphs.num_eager == 2 and graphs.num_replays == 0


def _padding_aware_reference():
    """The reference attention, but skipping negative slots as the Triton write_kv does."""

    def write_kv(key, value, k_cache, v_cache, slot_mapping):
        keep = slot_mapping >= 0
        ref.write_kv(key[keep], value[keep], k_cache, v_cache, slot_mapping[keep])

    return types.SimpleNamespace(__name__="test_reference", write_kv=write_kv,
                                 paged_decode_attention=ref.paged_decode_attention,
                                 paged_prefill_attention=ref.paged_prefill_attention)


def test_engine_with_graphs_matches_eager_engine(tiny_model):
    """Greedy tokens with decode replayed from (stand-in) graphs equal the eager engine's;
    batches of 5 and more sequences (above the largest bucket, 4) run eagerly."""
    model, _, _ = tiny_model
    cfg = EngineConfig(model_id="tiny", block_size=4, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=256,
                       attention_backend="reference", max_model_len=64, batch_invariant=False)
    prompts = [[3, 5, 7], [9] * 11, list(range(3, 24)), [4, 4], [8, 1, 30, 2, 6], [5] * 7]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (9, 4, 12, 6, 3, 10)]
    eager = LLMEngine(model, cfg, eos_token_ids=eos_ids_of(model))
    expected = [s.output_token_ids for s in eager.generate(prompts, params)]
    engine = LLMEngine(model, cfg, eos_token_ids=eos_ids_of(model))
    engine.runner.attention = _padding_aware_reference()
    capture = RecordingCapture()
    engine.runner.enable_cuda_graphs([1, 2, 4], -(-64 // 4), capture=capture)
    assert capture.captured == [4, 2, 1]
    got = [s.output_token_ids for s in engine.generate(prompts, params)]
    assert got == expected
    graphs = engine.runner.graphs
    assert graphs.num_replays > 0 and graphs.num_eager > 0
