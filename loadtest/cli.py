"""The load-test commands ``pdserve bench <name>`` and ``pdserve chaos``.

They live here, not in the product: ``services/cli.py`` finds them through the
``pdserve.commands`` entry-point group (``pyproject.toml``) and imports this module only when
one of them is run, so the serving code never imports its own benchmark harness.
"""

from __future__ import annotations

import importlib
import sys

#: ``pdserve bench <name> [options]``: the module whose ``main(argv)`` runs it (each parses its own options).
#: The component experiments (one kernel or one cost alone) live in ``loadtest/experiments/``.
BENCHMARKS = {"pipeline": "bench_pipeline", "bus": "bench_bus", "engine": "bench_engine", "modes": "bench_modes",
              "http": "bench_http", "itl": "bench_itl", "load": "loadgen", "gpu": "bench_gpu",
              "sim-validate": "sim_oos", "sim-fit-replay": "sim_validate", "cancel": "bench_cancel",
              "invariant": "experiments.bench_invariant", "block-kernel": "experiments.bench_block_kernel",
              "decode-paths": "experiments.bench_decode_paths", "grammar": "experiments.bench_grammar",
              "spec": "bench_spec", "cores": "bench_cores", "longmix": "bench_longmix",
              "amx-probe": "experiments.amx_probe", "hop": "experiments.bench_hop",
              "attention": "experiments.bench_attention"}


def bench(argv: list[str]) -> int:
    """``pdserve bench <name> [options]``: run one benchmark; exit status 2 for an unknown name."""
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: pdserve bench {{{','.join(sorted(BENCHMARKS))}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(f"loadtest.{BENCHMARKS[argv[0]]}").main(argv[1:])


def chaos(argv: list[str]) -> int:
    """``pdserve chaos [options]``: the fault-injection suite (``loadtest/chaos.py``)."""
    from loadtest.chaos import main

    return main(argv)
