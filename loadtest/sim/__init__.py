"""Profile, simulate and plan pdserve deployments past one machine (issue 16).

* :mod:`loadtest.sim.profile` — the versioned cost profile and its cached interpolations;
* :mod:`loadtest.sim.measure` — ``pdserve profile``: measures a profile with the engine's own code;
* :mod:`loadtest.sim.simulator` — the discrete-event simulator (real Scheduler and BlockManager);
* :mod:`loadtest.sim.plan` — ``pdserve plan``: the fewest workers that meet the SLOs;
* :mod:`loadtest.sim.validate` — simulated vs measured on the modes benchmark;
* :mod:`loadtest.sim.scale` — the at-scale table and plot of ``docs/scale.md``.
"""
