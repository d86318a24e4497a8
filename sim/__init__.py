"""Profile, simulate and plan pdserve deployments past one machine (issue 16).

* :mod:`sim.profile` — the versioned cost profile and its cached interpolations;
* :mod:`sim.measure` — ``pdserve profile``: measures a profile with the engine's own code;
* :mod:`sim.simulator` — the discrete-event simulator (real Scheduler and BlockManager);
* :mod:`sim.plan` — ``pdserve plan``: the fewest workers that meet the SLOs;
* :mod:`loadtest.sim_validate` — simulated vs measured on the modes benchmark;
* :mod:`sim.scale` — the at-scale table and plot of ``docs/scale.md``.
"""
