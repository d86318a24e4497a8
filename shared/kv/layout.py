"""What a KV hand-off message says about staged blocks: their layout and where they are."""

from __future__ import annotations

import msgspec


class KVLayout(msgspec.Struct, frozen=True):
    """Shape of one staged block: ``[num_layers, 2 (K, V), num_tokens, num_kv_heads, head_dim]``."""

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize


class KVHandle(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where decode finds a prompt's KV cache.

    ``block_hashes`` name the full blocks (content-addressed, shared across requests);
    ``tail_key`` names the request-scoped last partial block (None when the prompt fills
    whole blocks); ``num_tokens`` is how many prompt tokens the blocks cover.
    """

    store: str
    layout: KVLayout
    block_hashes: list[bytes]
    num_tokens: int
    tail_key: str | None = None
