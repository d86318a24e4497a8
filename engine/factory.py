"""Building an engine from settings (used by the prefill and decode workers and the
benchmarks, so all of them run the very same configuration)."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.loader import ensure_model, resolve_device, resolve_dtype
from engine.speculative import SpeculativeConfig
from shared.config import Settings, parse_batch_sizes
from shared.logging import get_logger
from shared.model_files import served_model_name

log = get_logger(__name__)


def engine_config(settings: Settings, dtype: torch.dtype | None = None) -> EngineConfig:
    kv_dtype = None if settings.kv_cache_dtype == "auto" else getattr(torch, settings.kv_cache_dtype)
    return EngineConfig(
        model_id=served_model_name(settings),
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_prefill_chunk_tokens=settings.max_prefill_chunk_tokens,
        max_model_len=settings.max_model_len,
        kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
        enable_prefix_caching=settings.enable_prefix_caching,
        kv_cache_dtype=kv_dtype,
        attention_backend=settings.attention_backend,
        weights=settings.weights,
        cuda_graphs=settings.cuda_graphs,
        cuda_graph_batch_sizes=tuple(parse_batch_sizes(settings.cuda_graph_batch_sizes)),
        kv_pinned_buffer_bytes=settings.kv_pinned_buffer_bytes,
        batch_invariant=settings.batch_invariant,
        block_dot=settings.block_dot,
        speculative=SpeculativeConfig(
            method=settings.speculative_method,
            num_tokens=settings.speculative_num_tokens,
            ngram_min=settings.speculative_ngram_min,
            ngram_max=settings.speculative_ngram_max,
            max_batch=settings.speculative_max_batch,
            row_cost=settings.speculative_row_cost,
            draft_model=settings.speculative_draft_model,
        ),
    )


def build_engine(settings: Settings) -> LLMEngine:
    """Ensure the model folder, pick device and dtype, set torch threads, load the engine."""
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    folder = ensure_model(settings)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    engine = LLMEngine.load(folder, engine_config(settings), dtype, device)
    log.info(
        "engine_loaded",
        model=str(folder),
        dtype=str(dtype),
        device=str(device),
        num_kv_blocks=engine.num_kv_blocks,
        kv_dtype=str(engine.kv_dtype),
        kv_bytes_per_token=engine.bytes_per_token,
        attention=engine.runner.attention.__name__,
        max_model_len=engine.max_model_len,
        torch_threads=torch.get_num_threads(),
        weights=settings.weights,
        block_dot=engine.runner.block_dot,
    )
    return engine
