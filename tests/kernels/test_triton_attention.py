"""The Triton attention kernels against the reference (cases in ``triton_cases_attention.py``):
in-process on a GPU, else in a child process under Triton's interpreter (see ``triton_env``)."""

from __future__ import annotations

import pytest

from tests.kernels.triton_env import in_process, run_cases_in_interpreter

if in_process():
    from tests.kernels.triton_cases_attention import *  # noqa: F403
else:

    #: the only cases allowed to skip under the interpreter on CPU (float8 needs a recent GPU)
    EXPECTED_SKIPS = {"float8 e4m3 needs compute capability >= 8.9"}

    @pytest.mark.slow  # minutes under the interpreter (measured 105-210 s on 2 shared cores)
    @pytest.mark.timeout(300)
    def test_triton_attention_under_interpreter():
        _, skips = run_cases_in_interpreter("triton_cases_attention.py")
        assert set(skips) <= EXPECTED_SKIPS, skips  # each one is also warned in this run's summary


def test_child_skips_are_read_from_the_child_summary():
    """The parent's view of the child's skips (``triton_env.child_skips``), on a real pytest ``-rs``
    summary: one reason per skipped case, and a count that does not add up fails."""
    from tests.kernels.triton_env import child_skips

    out = ("ss.                                                                      [100%]\n"
           "=========================== short test summary info ============================\n"
           "SKIPPED [2] tests/kernels/triton_cases_attention.py:80: float8 e4m3 needs compute capability >= 8.9\n"
           "1 passed, 2 skipped in 0.06s\n")
    assert child_skips(out) == ["float8 e4m3 needs compute capability >= 8.9"] * 2
    assert child_skips("3 passed in 1.0s\n") == []
    with pytest.raises(AssertionError):
        child_skips(out.replace("SKIPPED [2]", "SKIPPED [1]"))
