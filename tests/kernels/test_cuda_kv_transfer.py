"""The CUDA path: KV blocks move between the paged cache on the GPU and the KV store through
pinned host buffers with non-blocking copies, and the engine on CUDA gives the same greedy
tokens as transformers on CUDA. Run only where a GPU is present; skipped otherwise."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda") if torch.cuda.is_available() else None


def _pool(device, blocks=8, dtype=torch.float16) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=blocks, block_size=4, dtype=dtype,
                        device=device, model_id="t")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_blocks_round_trip_gpu_to_bytes_to_gpu(dtype):
    src = _pool(CUDA, dtype=dtype)
    src.kv.copy_(torch.randn(src.kv.shape, device=CUDA).to(dtype))
    full, tail = src.export_blocks([5, 2], num_tokens=[4, 3])
    assert len(full) == 2 * 2 * 4 * 2 * 8 * src.kv.element_size()
    assert len(tail) == 2 * 2 * 3 * 2 * 8 * src.kv.element_size()
    dst = _pool(CUDA, dtype=dtype)
    dst.import_block(0, full)
    dst.import_block(7, tail, num_tokens=3)
    torch.cuda.synchronize()
    assert torch.equal(dst.kv[:, :, 0], src.kv[:, :, 5])
    assert torch.equal(dst.kv[:, :, 7, :3], src.kv[:, :, 2, :3])
    assert not dst.kv[:, :, 7, 3:].any()  # the tail's unused slots stay empty


def test_gpu_blocks_are_byte_identical_to_cpu_blocks():
    """The stored format does not depend on the device: a block exported on the GPU is read
    by a CPU worker, and the other way round."""
    gpu, cpu = _pool(CUDA), _pool(torch.device("cpu"))
    gpu.kv.copy_(torch.randn(gpu.kv.shape, device=CUDA).half())
    cpu.kv.copy_(gpu.kv.cpu())
    assert bytes(gpu.export_blocks([3])[0]) == bytes(cpu.export_blocks([3])[0])
    back = _pool(CUDA)
    back.import_block(1, cpu.export_blocks([3])[0])
    torch.cuda.synchronize()
    assert torch.equal(back.kv[:, :, 1], gpu.kv[:, :, 3])


def test_copies_go_through_the_pinned_pool_without_host_waits(monkeypatch):
    """Host-to-device copies read pinned pool slots with non_blocking=True, and no new pinned
    memory is allocated per request."""
    seen = []
    real = torch.Tensor.copy_

    def spy(self, src, non_blocking=False):
        if self.is_cuda and not src.is_cuda:
            seen.append((src.is_pinned(), non_blocking))
        return real(self, src, non_blocking)

    src = _pool(torch.device("cpu"))
    pool = _pool(CUDA)
    assert pool.staging is not None and pool.staging.pool.memory.is_pinned()
    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    pool.import_block(0, src.export_blocks([0])[0])
    assert seen == [(True, True)]
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert torch.equal(pool.kv[:, :, 0].cpu(), src.kv[:, :, 0])


def test_engine_on_cuda_matches_generate(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.engine import LLMEngine, eos_ids_of
    from engine.model_runner import ATTN_IMPLEMENTATION, register_attention
    from shared.messages import SamplingParams

    register_attention()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=ATTN_IMPLEMENTATION).to(CUDA).eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                               attn_implementation="eager").to(CUDA).eval()
    engine = LLMEngine(model, EngineConfig(model_id="tiny", block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                           num_kv_blocks=128, attention_backend="reference"),
                       eos_token_ids=eos_ids_of(model))
    assert engine.device.type == "cuda"
    prompts = [[3, 5, 7], [9] * 11, list(range(3, 24))]
    eos = sorted(eos_ids_of(model)) or [model.config.vocab_size + 1]
    for prompt, seq in zip(prompts, engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))):
        ids = torch.tensor([prompt], device=CUDA)
        with torch.inference_mode():
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               eos_token_id=eos, pad_token_id=eos[0])
        assert seq.output_token_ids == out[0, len(prompt):].tolist()
