"""Property-based requests from the node's own OpenAPI schema: whatever a client sends to
any endpoint, the answer is never a 5xx (bad input is a 4xx in the API's shape)."""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from exo.devtools.api_fuzz import aim_at_the_tiny_model, fuzz_hub, fuzz_node, node_env, operations
from tests.support.node import TINY_MODEL_ID, ExoNode, running_node

OPERATIONS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/ollama/api/chat",
    "/ollama/api/generate",
    "/ollama/api/show",
]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, tiny_models_dir: Path) -> Iterator[ExoNode]:
    scratch = tmp_path_factory.mktemp("schemathesis")
    # A local hub with one tiny repo, so the hub search and add answer for real. The tiny
    # model's dir is read-only to the node: no fuzzed delete can remove it.
    hub = fuzz_hub(scratch / "hub")
    try:
        with running_node(
            scratch / "exo_home", node_env(tiny_models_dir, hub), ("--no-auto-place",), [TINY_MODEL_ID]
        ) as node:
            yield node
    finally:
        hub.stop()


@pytest.fixture(scope="module")
def api_schema(node: ExoNode) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{node.url}/openapi.json")


@pytest.mark.parametrize("path", OPERATIONS)
def test_generation_endpoints_never_answer_5xx(api_schema: schemathesis.BaseSchema, node: ExoNode, path: str):
    # Hypothesis driven directly: schemathesis' pytest plugin does not run on pytest 9.
    operation = api_schema[path]["POST"]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(
        max_examples=25, deadline=None, suppress_health_check=cast(list[HealthCheck], list(HealthCheck)), database=None
    )
    def never_5xx(case: schemathesis.Case) -> None:
        aim_at_the_tiny_model(case.body)
        case.call_and_validate(checks=[not_a_server_error], timeout=60)

    try:
        never_5xx()
    except BaseException:
        print(f"--- exo node log ---\n{node.logs()[-20000:]}")
        raise


CLUSTER_OPERATIONS = [
    ("POST", "/place_instance"),
    ("POST", "/instance"),
    ("GET", "/instance/previews"),
    ("GET", "/instance/placement"),
    ("GET", "/instance/{instance_id}"),
    ("DELETE", "/instance/{instance_id}"),
    ("POST", "/models"),
    ("POST", "/models/add"),
    ("DELETE", "/models/{model_id}"),
    ("POST", "/v1/cancel/{request_id}"),
    ("POST", "/bench/chat/completions"),
]
CLUSTER_EXAMPLES = int(os.environ.get("EXO_SCHEMATHESIS_EXAMPLES", "30"))


@pytest.mark.parametrize(("method", "path"), CLUSTER_OPERATIONS)
def test_cluster_endpoints_never_answer_5xx(api_schema: schemathesis.BaseSchema, node: ExoNode, method: str, path: str):
    operation = api_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(
        max_examples=CLUSTER_EXAMPLES,
        deadline=None,
        suppress_health_check=cast(list[HealthCheck], list(HealthCheck)),
        database=None,
    )
    def never_5xx(case: schemathesis.Case) -> None:
        aim_at_the_tiny_model(case.body)
        response = case.call(timeout=60)
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])

    try:
        never_5xx()
    except BaseException:
        print(f"--- exo node log ---\n{node.logs()[-20000:]}")
        raise


# Every operation of the document that the tests above do not drive, a few examples each
# (python bench/api_fuzz.py runs all of them with more). Placing and deleting instances
# and downloads are among them: the tiny model's dir is this node's, read-only to it.
OTHER_EXAMPLES = int(os.environ.get("EXO_SCHEMATHESIS_OTHER_EXAMPLES", "8"))


def test_every_other_operation_never_answers_5xx(node: ExoNode):
    covered = {("POST", path) for path in OPERATIONS} | set(CLUSTER_OPERATIONS)
    result = fuzz_node(node.url, OTHER_EXAMPLES, skip=frozenset(covered))
    print(result.report())
    others = {f"{method} {path}" for method, path in operations(node.url) if (method, path) not in covered}
    assert set(result.per_operation) == others and len(others) >= 14, result.per_operation
    assert result.server_errors == [], result.server_errors[:5]
