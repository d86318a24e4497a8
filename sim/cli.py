"""``pdserve profile``, ``pdserve plan`` and ``pdserve simulate`` (entry points of the
``pdserve.commands`` group, imported only when run, like ``pdserve bench``)."""

from __future__ import annotations


def profile(argv: list[str]) -> int:
    """``pdserve profile [options]``: measure a cost profile (``sim/measure.py``)."""
    from sim.measure import main

    return main(argv)


def plan(argv: list[str]) -> int:
    """``pdserve plan [options]``: the fewest workers that meet the SLOs (``sim/plan.py``)."""
    from sim.plan import main

    return main(argv)


def simulate(argv: list[str]) -> int:
    """``pdserve simulate [options]``: one topology, one trace (``sim/run.py``)."""
    from sim.run import main

    return main(argv)
