"""Conditional disaggregation served end to end on the bundled SmolLM2 (issue 15).

A disaggregated server (1 prefill + 1 decode worker, CPU) with ``--max-local-prefill-length 16``
and ``--min-prefill-queue-tokens 0`` sends a prompt to its decode worker whenever the local
prefills in flight there, this one included, total at most 16 tokens, so a concurrent burst of
5-10-token prompts splits between prompts computed on the decode worker's prefill thread and
prompts whose KV comes over from the prefill worker. Greedy outputs must not depend on which
path a prompt took.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Iterator

import httpx
import pytest
from serve_process import PROMPTS, ServeProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    # float32: greedy tokens compared across different batches (see tests/e2e/test_serve.py)
    flags = ["--max-local-prefill-length", "16", "--min-prefill-queue-tokens", "0"]
    srv = ServeProcess(["--dtype", "float32", *flags])
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.last_output


def complete(url: str, prompt: str) -> str:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "smollm2", "prompt": prompt, "max_tokens": 12, "temperature": 0},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def kv_paths(url: str) -> dict[str, float]:
    """``pdserve_kv_transfers_total`` by path (ok outcomes) from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    paths: dict[str, float] = {}
    for m in re.finditer(r"^pdserve_kv_transfers_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("outcome") == "ok":
            paths[labels["path"]] = paths.get(labels["path"], 0.0) + float(m.group(2))
    return paths


def test_local_and_remote_prefills_give_the_same_tokens(server: ServeProcess) -> None:
    prompts = PROMPTS[:8]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        burst = list(pool.map(lambda p: complete(server.url, p), prompts))
    paths = kv_paths(server.url)
    assert paths.get("local", 0) >= 1, paths  # some prompts were prefilled on the decode worker
    assert sum(v for k, v in paths.items() if k != "local") >= 1, paths  # and some remotely
    # one at a time every prompt (<= 10 tokens) is local: the same tokens
    alone = [complete(server.url, p) for p in prompts]
    assert kv_paths(server.url)["local"] == paths["local"] + len(prompts)
    assert burst == alone
    assert all(text.strip() for text in alone)
    assert "Paris" in alone[0]
