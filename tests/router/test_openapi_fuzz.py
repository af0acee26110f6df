"""schemathesis against the router's own OpenAPI schema (issue 12): no 5xx, no response that
violates the schema (status codes, content types and bodies as documented).

The app runs with fake workers on a loopback uvicorn in a thread of its own (schemathesis calls
are synchronous). Generation is seeded (``derandomize``) and bounded: ``MAX_EXAMPLES`` cases per
operation, both valid and invalid inputs (positive and negative modes), a few seconds in all.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from test_http_gateway import env, live_server

from pdserve.tokenizer import Tokenizer
from router.http import build_app

pytestmark = pytest.mark.timeout(240)

MAX_EXAMPLES = 25  # per operation and generation mode
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture
def server_url(tokenizer: Tokenizer) -> Iterator[str]:
    """The router app (fake workers, max_model_len 512) on a loopback port, in its own thread."""
    ready: list[str] = []
    stop = threading.Event()

    async def main() -> None:
        # short outputs: generated max_tokens would otherwise decode hundreds of fake tokens
        async with env(tokenizer, decode={"step_s": 0.0005}) as e:
            async with live_server(build_app(e.router)) as url:
                ready.append(url)
                while not stop.is_set():
                    await asyncio.sleep(0.05)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    for _ in range(600):
        if ready or not thread.is_alive():
            break
        threading.Event().wait(0.05)
    assert ready, "the test server did not start"
    yield ready[0]
    stop.set()
    thread.join(30)


def test_schemathesis_finds_no_5xx_and_no_schema_violation(server_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{server_url}/openapi.json")
    # the error statuses are documented (router/http/openapi.py), FastAPI's unused 422 is not
    chat = schema.raw_schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "429", "503"} <= set(chat) and "422" not in chat
    failures: list[str] = []
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=MAX_EXAMPLES,
                derandomize=True,
                database=None,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: schemathesis.Case) -> None:
                response = case.call(base_url=server_url, timeout=30)
                case.validate_response(response, checks=CHECKS)

            try:
                run()
            except Unsatisfiable:  # no input to make invalid (an operation without parameters)
                assert mode is GenerationMode.NEGATIVE and op.method == "get", op.path
            except Exception as e:  # noqa: BLE001 - collect every operation's failure
                failures.append(f"{op.method.upper()} {op.path} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)
    r = httpx.post(
        f"{server_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10
    )
    assert r.status_code == 200, r.text
