"""The engine on the Triton kernels against transformers' generate (cases in
``triton_cases_engine.py``), under Triton's interpreter in a child process on CPU."""

from __future__ import annotations

import pytest

from tests.kernels.triton_env import in_process, run_cases_in_interpreter

if in_process():
    from tests.kernels.triton_cases_engine import *  # noqa: F403
else:

    @pytest.mark.slow  # minutes under the interpreter (measured 105-210 s on 2 shared cores)
    @pytest.mark.timeout(400)
    def test_triton_engine_under_interpreter():
        _, skips = run_cases_in_interpreter("triton_cases_engine.py", timeout_s=380)
        assert skips == [], skips  # on CPU every case runs (a skip is also warned in this run's summary)
