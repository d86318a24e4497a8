"""The greedy reference texts of ``pdserve chaos``, kept on disk between runs: computing them
with transformers' ``generate`` takes minutes on a loaded CPU, and three runs of one scenario
need the same ones. The key is the model folder's config and weights index, the prompts and
``max_tokens``; the file sits in the model folder (``.chaos-references-<key>.json``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path


def cached_references(folder: Path, prompts: list[str], max_tokens: int,
                      compute: Callable[[], list[str]]) -> list[str]:
    """``compute()``'s texts, from the cache when the same model, prompts and length were done."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json", "model.safetensors"):
        p = folder / name
        if p.exists():
            h.update(f"{name}:{p.stat().st_size}:{p.stat().st_mtime_ns}".encode())
    h.update(json.dumps([prompts, max_tokens]).encode())
    path = folder / f".chaos-references-{h.hexdigest()[:16]}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    texts = compute()
    try:
        path.write_text(json.dumps(texts))
    except OSError:
        pass  # a read-only model folder: no cache
    return texts
