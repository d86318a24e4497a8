"""torchao's CPU quantized linears against the block kernel (issue 12's "prefer a library"
lever), one process, 2 threads, SmolLM2-135M's MLP shapes, float32 activations.

torchao is not a dependency: ``pip install --no-deps torchao`` into a scratch folder and put
it on ``PYTHONPATH``, then ``python -m loadtest.bench_torchao``. Each cell is the median of 40
calls; a configuration torchao refuses on this CPU or dtype prints why.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings

import torch


def _median_ms(fn, *args, calls: int = 40, **kwargs) -> float:
    """Median milliseconds of ``fn(*args, **kwargs)`` over ``calls`` calls (after one warm-up)."""
    fn(*args, **kwargs)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    import torchao.quantization as tq
    from torchao.quantization.granularity import PerGroup

    from kernels.cpu import quant

    ext = quant.load()
    configs = {
        "torchao int4 weight-only g32 (tile_packed_to_4d)":
            lambda: tq.Int4WeightOnlyConfig(group_size=32, int4_packing_format="tile_packed_to_4d"),
        "torchao int8 act + int4 weight g32": lambda: tq.Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(32)),
        "torchao int8 weight-only": lambda: tq.Int8WeightOnlyConfig(),
        "torchao int8 act + int8 weight": lambda: tq.Int8DynamicActivationInt8WeightConfig(),
    }
    gen = torch.Generator().manual_seed(0)
    for n, k in ((3072, 576), (576, 1536)):
        linear = torch.nn.Linear(k, n, bias=False).eval()
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        d = torch.rand(n, k // 32, generator=gen) * 0.02
        m = -8 * d
        for rows in (1, 64):
            x = torch.randn(rows, k, generator=gen)
            cells = {"torch float32 linear": _median_ms(linear, x),
                     "pdserve Q4 blocks, float32 loops": _median_ms(ext.q4_linear, x, codes, d, m),
                     "pdserve Q4 blocks, int8 activations": _median_ms(ext.q4_linear, x, codes, d, m, int8=True)}
            for name, config in configs.items():
                try:
                    layer = copy.deepcopy(linear)
                    tq.quantize_(layer, config())
                    with torch.inference_mode():
                        cells[name] = _median_ms(layer, x)
                except Exception as exc:  # torchao refuses: say why
                    cells[name] = f"refused: {type(exc).__name__}: {str(exc)[:70]}"
            print(f"{n}x{k}, {rows} row(s):")
            for name, v in cells.items():
                print(f"   {name:48} {v if isinstance(v, str) else f'{v:8.3f} ms'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
