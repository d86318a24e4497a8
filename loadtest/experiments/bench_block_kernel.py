"""Single-thread GFLOP/s of the GGUF block kernel (``kernels/cpu/quant_block.h``): its float32
loops against its int8-activation loops (``int8=True``, ``PD_BLOCK_DOT=int8``) and its bf16
dot-product loops (``bf16=True``, AVX512-BF16 only) and its AMX tiles (``amx=True``, AMX CPUs
only), interleaved in one run (ratios are what counts on a shared machine), per shape, row count
and block type; and torch's GEMM (oneDNN; AMX tiles where the CPU has them) on a dense weight of
the same shape in the machine's dtype (bf16 where the kernel has bf16 dot products, else
float32), the rate issue 29 asks the block loops to reach (80 % of it at 64+ rows): the
``kernel/oneDNN`` column is the fastest of the kernel's batch-invariant paths (float32, bf16,
amx) over it.

``python -m loadtest.experiments.bench_block_kernel [--rows 1,4,16,64] [--repeats 7] [--calls 30]``

``--cold`` measures instead what a decode step sees: each block type of the model's largest
matrix (SmolLM2-135M's LM head, 49152 x 576) called on blocks that come from memory (a 256 MB
buffer read between calls), one call at a time, beside a sequential read of the same bytes
(``torch.sum``): the kernel's read rate against the core's (docs/decisions.md, "AVX2: 8-bit
blocks read in one stream").

Each cell is the minimum over ``repeats`` rounds of the mean time of ``calls`` calls; within a
round the two paths run back to back. FLOPs are ``2 M N K``. Prints the load average before
and after. Without AVX512-BF16 the bf16 column is left out (stated in the output).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

SHAPES = [(1536, 576), (576, 1536)]  # (N out, K in): SmolLM2-135M's MLP up and down


def _layer(bits: int, n: int, k: int, gen: torch.Generator):
    """Random blocks: codes, d, m as the kernel takes them."""
    codes = torch.randint(0, 256, (n, k // 2 if bits == 4 else k), generator=gen, dtype=torch.uint8)
    if bits == 8:
        codes = codes.view(torch.int8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half()  # float16, as GGUF stores them
    m = -8 * d if bits == 4 else torch.empty(0, dtype=torch.float16)
    return codes, d, m


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def _best_mean_s(best: float, calls: int, fn, *args, **kwargs) -> float:
    """The smaller of ``best`` and the mean seconds of ``calls`` calls of ``fn(*args, **kwargs)``
    (after one warm-up call)."""
    fn(*args, **kwargs)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args, **kwargs)
    return min(best, (time.perf_counter() - t0) / calls)


def cold_rates(ext, rows: list[int], repeats: int, shape: tuple[int, int] = (49152, 576)) -> None:
    """Print, per block type and row count, the float32 loops' time for one call of ``shape``
    (N out, K in) on blocks evicted from the caches before each call (a 256 MB buffer summed),
    the blocks' bytes read per second, and a sequential sum of a float32 tensor of as many bytes,
    timed the same way (GB/s); the best of ``repeats`` calls."""
    gen = torch.Generator().manual_seed(0)
    sweep = torch.ones(64 << 20, dtype=torch.float32)
    n, k = shape
    for qtype, bits in (("Q4_1", 4), ("Q8_0", 8)):
        codes, d, m = _layer(bits, n, k, gen)
        kernel = ext.q4_linear if bits == 4 else ext.q8_linear
        size = codes.numel() + 2 * (d.numel() + m.numel())
        flat = torch.ones(size // 4, dtype=torch.float32)
        for r in rows:
            x = torch.randn(r, k, generator=gen)
            best, read = float("inf"), float("inf")
            for _ in range(repeats):
                sweep.sum()
                t0 = time.perf_counter()
                kernel(x, codes, d, m)
                best = min(best, time.perf_counter() - t0)
                sweep.sum()
                t0 = time.perf_counter()
                flat.sum()
                read = min(read, time.perf_counter() - t0)
            print(f"{n:>5}x{k:<4} {qtype:>5} {r:>4}  {best * 1e3:8.2f} ms  {size / best / 1e9:6.2f} GB/s"
                  f"  (sequential sum of {size / 1e6:.1f} MB: {size / read / 1e9:6.2f} GB/s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench block-kernel")
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cold", action="store_true", help="the LM head's shape on blocks read from memory (see above)")
    args = p.parse_args(argv)
    from kernels.cpu import quant

    torch.set_num_threads(args.threads)
    ext = quant.load()
    paths = ["float32", "int8"] + (["bf16"] if ext.has_bf16 else []) + (["amx"] if getattr(ext, "has_amx", False) else [])
    print(f"isa {ext.isa}, bf16 dot products: {'yes' if ext.has_bf16 else 'NO (this CPU lacks AVX512-BF16)'}, "
          f"AMX tiles: {'yes' if getattr(ext, 'has_amx', False) else 'no'}, "
          f"{args.threads} thread(s), load average {_load()}")
    if args.cold:
        cold_rates(ext, [int(r) for r in args.rows.split(",")], args.repeats)
        print(f"load average {_load()}")
        return 0
    gen = torch.Generator().manual_seed(0)
    dense = torch.bfloat16 if ext.has_bf16 else torch.float32
    print(f"{'shape':>10} {'type':>5} {'rows':>4}  " + "  ".join(f"{b:>8}" for b in paths)
          + "  " + "  ".join(f"{b + '/float32':>13}" for b in paths[1:])
          + f"  {'oneDNN ' + str(dense).removeprefix('torch.'):>12}  kernel/oneDNN")
    for n, k in SHAPES:
        for qtype, bits in (("Q4_1", 4), ("Q8_0", 8)):
            codes, d, m = _layer(bits, n, k, gen)
            kernel = ext.q4_linear if bits == 4 else ext.q8_linear
            w = torch.randn(n, k, generator=gen).to(dense)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=gen)
                xd = x.to(dense)
                best = {b: float("inf") for b in [*paths, "onednn"]}
                for _ in range(args.repeats):
                    best["onednn"] = _best_mean_s(best["onednn"], args.calls, torch.nn.functional.linear, xd, w)
                    for b in paths:
                        kw = {b: True} if b != "float32" else {}
                        best[b] = _best_mean_s(best[b], args.calls, kernel, x, codes, d, m, **kw)
                rates = {b: 2 * rows * n * k / best[b] / 1e9 for b in best}
                ratio = "  " + "  ".join(f"{rates[b] / rates['float32']:12.2f}x" for b in paths[1:])
                exact = max(rates[b] for b in paths if b != "int8")
                print(f"{n:>4}x{k:<5} {qtype:>5} {rows:>4}  " + "  ".join(f"{rates[b]:8.1f}" for b in paths) + ratio
                      + f"  {rates['onednn']:12.1f}  {exact / rates['onednn']:12.2f}x")
    print(f"load average {_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
