"""schemathesis over the whole OpenAPI document of a real node: valid and invalid
requests for every operation, and not one may be answered with a 5xx (bad input is a 4xx
in the API's own shape).

    python bench/api_fuzz.py                  # 40 examples per operation (>= 1000 requests)
    python bench/api_fuzz.py --examples 5

Starts its own node on 127.0.0.1, with a local hub (exo.devtools.fake_hub, holding one
tiny repo) so /models/search and /models/add get real answers, and the tiny model in a
read-only models dir, so no request can delete it; prints the figures, exits non-zero on
a 5xx. The suite runs it with a few examples (tests/api/test_api_schemathesis.py)."""

import argparse
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from exo.devtools.fake_hub import FakeHub
from exo.devtools.load_test import place_and_wait, start_node, stop_node
from exo.devtools.tiny_models import make_tiny_llama

MODEL_ID = "acme/tiny"
# Output length fields, per API; capped so that each generated request finishes quickly.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_TOKENS = 4
# /instance/await waits up to `timeout` seconds for an instance: keep it short.
MAX_AWAIT_SECONDS = 2


@dataclass
class FuzzResult:
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    per_operation: Counter[str] = field(default_factory=Counter)

    def report(self) -> str:
        classes = Counter(f"{status // 100}xx" for status in self.statuses.elements())
        return (
            f"{self.requests} requests over {len(self.per_operation)} operations, "
            f"{dict(sorted(classes.items()))}, {len(self.server_errors)} unexpected 5xx"
        )


def _short(value: object) -> bool:
    # Floats count too: pydantic takes 3975268.0 as an int field's value.
    return not (isinstance(value, int | float) and not isinstance(value, bool) and value > MAX_TOKENS)


def aim_at_the_tiny_model(body: object, model_id: str = MODEL_ID) -> None:
    """Most random model names are just a 404; name the placed model instead so requests
    get as far as generation, and keep generation short. Values of the wrong type stay,
    to be rejected."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and body["model"]:
        body["model"] = model_id
    for name in LENGTH_FIELDS:
        if name not in body or not _short(body[name]):
            body[name] = MAX_TOKENS
    options = body.setdefault("options", {})
    if isinstance(options, dict) and ("num_predict" not in options or not _short(options["num_predict"])):
        options["num_predict"] = MAX_TOKENS


def operations(url: str) -> list[tuple[str, str]]:
    """(METHOD, path) of every operation the node's OpenAPI document lists."""
    document = httpx.get(f"{url}/openapi.json", timeout=30).json()
    return [(method.upper(), path) for path, item in document["paths"].items() for method in item]


def fuzz_operation(schema: schemathesis.BaseSchema, method: str, path: str, examples: int, result: FuzzResult) -> None:
    operation = schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=cast(list[HealthCheck], list(HealthCheck)),
        database=None,
    )
    def call(case: schemathesis.Case) -> None:
        aim_at_the_tiny_model(case.body)
        if path == "/instance/await":
            case.query = {**(case.query if isinstance(case.query, dict) else {}), "timeout": MAX_AWAIT_SECONDS}
        response = case.call(timeout=60)
        result.requests += 1
        result.per_operation[f"{method} {path}"] += 1
        result.statuses[response.status_code] += 1
        if response.status_code >= 500:
            result.server_errors.append(f"{case.as_curl_command()} -> {response.status_code} {response.text[:300]}")

    call()


def fuzz_node(url: str, examples: int, skip: frozenset[tuple[str, str]] = frozenset()) -> FuzzResult:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    result = FuzzResult()
    for method, path in operations(url):
        if (method, path) not in skip:
            fuzz_operation(schema, method, path, examples, result)
            print(f"{method} {path}: {result.per_operation[f'{method} {path}']} requests", flush=True)
    return result


HUB_REPO_ID = "acme/hub-tiny"


def fuzz_hub(root: Path) -> FakeHub:
    """A running local hub holding one tiny repo, for the node's hub search and add."""
    make_tiny_llama(root / HUB_REPO_ID.replace("/", "--"))
    return FakeHub(root).start()


def node_env(models_dir: Path, hub: FakeHub) -> dict[str, str]:
    return {"EXO_MODELS_READ_ONLY_DIRS": str(models_dir), "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=40, help="examples per operation")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exo-fuzz-") as scratch:
        models_dir = Path(scratch) / "models"
        make_tiny_llama(models_dir / MODEL_ID.replace("/", "--"))
        hub = fuzz_hub(Path(scratch) / "hub")
        process, url = start_node(
            Path(scratch) / "home", node_env(models_dir, hub), ("--no-auto-place",), offline=False
        )
        try:
            place_and_wait(url, MODEL_ID)
            result = fuzz_node(url, args.examples)
        finally:
            stop_node(process)
            hub.stop()
    print(result.report())
    for line in result.server_errors[:20]:
        print(f"5xx: {line}")
    sys.exit(1 if result.server_errors else 0)


if __name__ == "__main__":
    main()
