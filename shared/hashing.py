"""Content addresses of KV blocks.

A full block of ``block_size`` tokens is named by
``SHA-256(parent_hash || len(extra) || extra || token ids as little-endian int32)``,
where ``parent_hash`` is the previous block's hash (32 zero bytes for the first block) and
``extra`` is bytes that must also match for the KV to be reusable (model id, block size,
cache salt). The KV dtype is not hashed: a worker's prefix cache has one dtype, and store keys
carry the dtype beside the hash (``shared/kv/keys.py``). Chaining makes a block's hash depend on the whole prefix, so equal
hashes mean equal prefixes; this is the scheme of vLLM's automatic prefix caching
(``vllm/v1/core/kv_cache_utils.py``), with SHA-256 so the hash is stable across processes
and hosts (never Python's ``hash()``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = bytes(32)
HASH_BYTES = 32


def hash_extra(model_id: str, block_size: int, cache_salt: str = "") -> bytes:
    """The ``extra`` bytes for blocks of one model, block size and tenant salt."""
    return f"{model_id}\x00{block_size}\x00{cache_salt}".encode()


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra: bytes) -> bytes:
    """32-byte hash of one block given its parent's hash and its token ids."""
    h = hashlib.sha256()
    h.update(parent_hash)
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes,
    parent_hash: bytes = ROOT_HASH,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` (a partial last block gets none).

    Args:
        token_ids: the tokens, from the start of the sequence (or from the block after
            ``parent_hash``).
        block_size: tokens per block, > 0.
        extra: see :func:`hash_extra`.
        parent_hash: hash of the block before ``token_ids[0]``.

    Returns:
        ``len(token_ids) // block_size`` hashes of 32 bytes each.
    """
    out = []
    parent = parent_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        out.append(parent)
    return out


def num_reusable_blocks(num_tokens: int, block_size: int) -> int:
    """How many of a prompt's leading full blocks may come from a prefix cache or the KV store.

    At least one token is always left to compute, so that a fully cached prompt still gets
    the logits of its last token: the run stops before the block holding the last token
    (vLLM's automatic prefix caching keeps the same rule). ``num_tokens`` >= 1.
    """
    return (num_tokens - 1) // block_size

