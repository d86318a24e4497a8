"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis): whatever the body, the
gateway never answers 5xx, and every error is an OpenAI error object. Runs against the
gateway in-process with a fake pipeline."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_gateway import make, texts

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def api_schema(tiny_model_dir):
    app, _ = make(tiny_model_dir, lambda task: texts(task.meta.request_id, ["fuzzed"]))
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def test_every_operation_never_answers_5xx(api_schema):
    ops = operations(api_schema)
    paths = {op.path for op in ops}
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"} <= paths
    statuses: dict[int, int] = {}
    for op in ops:
        examples = 80 if op.method.upper() == "POST" else 10

        # derandomize: the examples follow from the test itself, so a failure reproduces
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)
        @given(case=op.as_strategy(), right_model=st.booleans())
        def check(case, right_model):
            if right_model and isinstance(case.body, dict):
                case.body["model"] = "tiny-llama"  # get past the model check, into the pipeline
            response = case.call()
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"]

        check()
    # the fuzzer reached the pipeline (valid bodies) as well as the validation errors
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 20, statuses
