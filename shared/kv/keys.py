"""KV store keys, built by one function.

Two kinds of key, both under the deployment's namespace:

* ``blk`` — a full block, content-addressed by its KV dtype and chained block hash
  (``<dtype>-<hex>``). Shared by every
  request and worker whose prompt has that prefix; leased for ``PD_KV_BLOCK_TTL_S``.
* ``tail`` — the request-scoped last, partial block of a prompt, keyed by request id;
  deleted by decode as soon as it has loaded it, leased for ``PD_KV_TAIL_TTL_S`` otherwise.

Redis keys are ``<ns>:kv:<kind>:<id>``; the shared-memory store uses the same string as a
relative path ``<kind>/<id>`` under its folder.
"""

from __future__ import annotations

import re

BLOCK = "blk"
TAIL = "tail"
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def kv_key(kind: str, ident: str | bytes) -> str:
    """The store-independent key ``<kind>/<id>`` of a block (ident = 32-byte hash) or a tail
    (ident = request id).

    Raises:
        ValueError: unknown kind, or an id with characters unsafe in a path or key.
    """
    if kind not in (BLOCK, TAIL):
        raise ValueError(f"unknown KV key kind {kind!r}")
    text = ident.hex() if isinstance(ident, bytes) else ident
    if not _ID.match(text) or text in (".", ".."):
        raise ValueError(f"unsafe KV key id {text!r}")
    return f"{kind}/{text}"


def block_key(block_hash: bytes, dtype: str) -> str:
    """Key of a full block: its dtype and hash (the hash itself covers model, block size, salt)."""
    return kv_key(BLOCK, f"{dtype}-{block_hash.hex()}")


def tail_key(request_id: str) -> str:
    return kv_key(TAIL, request_id)


def redis_key(namespace: str, key: str) -> str:
    """Redis spelling of a store key: ``<ns>:kv:<kind>:<id>``."""
    kind, ident = key.split("/", 1)
    return f"{namespace}:kv:{kind}:{ident}"
