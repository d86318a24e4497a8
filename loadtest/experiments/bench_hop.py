"""The KV hand-off's copies alone, for one long prompt: export out of a paged pool, staging into
the KV store, reading it back and importing it into another pool (issue 29's long-prompt tail).

``pdserve bench hop [--tokens 5900] [--repeats 4] [--store shm|redis]``

Builds two :class:`engine.kv_cache.PagedKVCache` pools shaped like the served model's (layers, KV
heads, head size, the README's dtype and block size) filled with random KV, and per repeat times,
in milliseconds:

* ``export``: :meth:`PagedKVCache.export_blocks` of the prompt's blocks (the prefill worker's
  engine thread does this between steps);
* ``put``: :class:`services.prefill.worker.KVStager` staging them (a thread on the prefill worker);
* ``get + import``: the decode side read as it runs (:meth:`KVStore.get_views`, then
  :meth:`PagedKVCache.import_block` per block), against the plain ``get`` it replaced.

No model runs: the figures are the copies' own cost on this machine, which is what the hand-off
adds to a long prompt's first inter-token gap when the cores are otherwise free. The CPU and its
flags are printed with them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import uuid

import torch

from engine.kv_cache import PagedKVCache
from shared.config import Settings
from shared.kv import block_key, open_store


def _pool(settings: Settings, num_blocks: int, config, dtype: torch.dtype) -> PagedKVCache:
    """A CPU pool shaped as engine.engine.LLMEngine shapes its own for this model config."""
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return PagedKVCache(config.num_hidden_layers, num_kv_heads, head_dim, num_blocks, settings.block_size, dtype,
                        torch.device("cpu"), "bench-hop")


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig

    from engine.factory import engine_config
    from engine.model.loader import resolve_device, resolve_dtype
    from engine.outputs import PromptKV
    from loadtest.bench_cores import cpu_line
    from services.common.model import servable_model_folder
    from services.prefill.worker import KVStager

    p = argparse.ArgumentParser(prog="pdserve bench hop", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=5900)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--store", choices=["shm", "redis"], default="shm")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.tokens < 16:
        p.error("--repeats must be at least 1 and --tokens at least one block")
    settings = Settings.from_env().replace(kv_store=args.store, namespace=f"hop{uuid.uuid4().hex[:8]}")
    config = AutoConfig.from_pretrained(servable_model_folder(settings))
    # the workers' KV dtype (LLMEngine: PD_KV_CACHE_DTYPE, else the model's compute dtype)
    dtype = engine_config(settings).kv_cache_dtype or resolve_dtype(settings.dtype, resolve_device("cpu"))
    bs = settings.block_size
    num_full = args.tokens // bs
    src, dst = _pool(settings, num_full + 8, config, dtype), _pool(settings, num_full + 8, config, dtype)
    src.kv.copy_(torch.randn(src.kv.shape).to(src.kv.dtype))
    ids = list(torch.randperm(num_full + 8)[:num_full].tolist())
    store = open_store(settings)
    stager = KVStager(store, 60.0, 60.0)
    print(f"pdserve bench hop: {cpu_line()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"   {args.tokens} tokens = {num_full} full blocks of {bs}, {args.store} store, {src.dtype}")
    rows = {"export": [], "put": [], "get_views + import": [], "get + import": []}
    try:
        for rep in range(args.repeats):
            t = time.perf_counter()
            blocks = src.export_blocks(ids)
            rows["export"].append(time.perf_counter() - t)
            hashes = [os.urandom(32) for _ in ids]
            prompt_kv = PromptKV(block_hashes=hashes, blocks=blocks, tail=None, num_tail_tokens=0,
                                 num_tokens=num_full * bs)
            t = time.perf_counter()
            _, written = stager.stage(f"hop-{rep}", prompt_kv, src.layout)
            rows["put"].append(time.perf_counter() - t)
            keys = [block_key(h, src.layout.dtype) for h in hashes]
            reads = [("get_views + import", store.get_views), ("get + import", store.get)]
            for name, read in reads if rep % 2 == 0 else reads[::-1]:  # alternating which goes first
                t = time.perf_counter()
                values = read(keys)
                for block_id, value in zip(ids, values):
                    dst.import_block(block_id, value)
                del values
                rows[name].append(time.perf_counter() - t)
            store.delete(keys)
        mb = written / 1e6
        for name, times in rows.items():
            ms = [x * 1e3 for x in times]
            print(f"   {name:<20} median {statistics.median(ms):7.1f} ms  min {min(ms):7.1f}  max {max(ms):7.1f}"
                  f"  ({mb / (statistics.median(ms) / 1e3) / 1e3:.2f} GB/s over {mb:.1f} MB)")
    finally:
        store.clear()
        store.close()
        if args.store == "shm":
            shutil.rmtree(store.root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
