"""Component experiments: one kernel or one cost measured alone (the GGUF block kernel, the
decode step's weight paths, batch-invariant numerics, grammar masks), each reachable as
``pdserve bench <name>`` (``loadtest/cli.py``) and quoted in ``docs/decisions.md``."""
