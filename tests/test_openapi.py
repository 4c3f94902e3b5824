"""The API's OpenAPI description (/openapi.json) fuzzed with schemathesis against a real `edgerun serve`: requests
generated from every operation's schema, valid and not, never get a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from test_serve import API_KEY, Serving


@pytest.fixture(scope="module")
def small_server(shipped_path: Path) -> Iterator[Serving]:
    # A 64-token context: a generated max_tokens is a quick 413 or a short answer, never minutes of decoding.
    s = Serving("--api-key", API_KEY, "--no-cluster", "--max-context", "64")
    yield s
    s.close()


@pytest.fixture
def api_schema(small_server: Serving):
    return schemathesis.openapi.from_url(small_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_request_gets_a_5xx(case) -> None:
    case.call_and_validate(headers={"authorization": f"Bearer {API_KEY}"}, checks=[not_a_server_error])


def test_the_description_names_every_route(small_server: Serving) -> None:
    import json

    code, text = small_server.get("/openapi.json")
    described = set(json.loads(text)["paths"])
    assert code == 200 and {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/chat",
                            "/tokenize"} <= described
