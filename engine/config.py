"""The engine's sizes and switches (built from the service settings by ``engine.factory``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.speculative import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine sizes. ``num_kv_blocks`` 0 = from ``kv_cache_memory_bytes``."""

    model_id: str
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_chunk_tokens: int = 0
    max_model_len: int = 0
    kv_cache_memory_bytes: int = 1 << 30
    num_kv_blocks: int = 0
    enable_prefix_caching: bool = True
    kv_cache_dtype: torch.dtype | None = None
    attention_backend: str = "auto"
    weights: str = "float"  # PD_WEIGHTS: float, auto (as stored in the source file) or int8
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    kv_pinned_buffer_bytes: int = 256 << 20
    batch_invariant: bool = True  # PD_BATCH_INVARIANT: engine.model.batch_invariant
    block_dot: str = "float32"  # PD_BLOCK_DOT: engine.model.quant.resolve_block_dot (auto, float32, int8, bf16)
    speculative: SpeculativeConfig = SpeculativeConfig()  # PD_SPECULATIVE_*: engine.speculative
