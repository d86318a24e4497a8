"""The Triton attention kernels against the reference (cases in ``triton_cases_attention.py``):
in-process on a GPU, else in a child process under Triton's interpreter (see ``triton_env``)."""

from __future__ import annotations

import re

import pytest

from tests.kernels.triton_env import in_process, run_cases_in_interpreter

if in_process():
    from tests.kernels.triton_cases_attention import *  # noqa: F403
else:

    @pytest.mark.timeout(300)
    def test_triton_attention_under_interpreter():
        out = run_cases_in_interpreter("triton_cases_attention.py")
        assert re.search(r"\b\d+ passed\b", out) and " failed" not in out
