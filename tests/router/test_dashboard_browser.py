"""/dashboard in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

The router serves fake workers on loopback. Every request the page makes is intercepted: one to
any host other than the loopback fails the test, as does any failed request, any HTTP error
response, any console error or uncaught exception. The page must list every worker, its charts
must change after traffic, a killed worker must raise the banner, a worker that joins must
appear, and a request's record must open from the requests table. A screenshot is saved under
the test's temporary directory.

Playwright never downloads a browser here: it launches ``/usr/bin/chromium`` (``make setup``
installs it as root; without it the test fails and says how to install it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fake_workers import FakeDecode, _serve, start_fake_cluster
from playwright.async_api import Page, Route, async_playwright
from test_http_gateway import live_server

from pdserve.tokenizer import Tokenizer
from pdserve.worker_info import WorkerInfo
from router.background import drain_background
from router.http import build_app
from router.serving import Router, RouterConfig

pytestmark = pytest.mark.timeout(180)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    path = shutil.which("chromium") or (CHROMIUM if os.path.exists(CHROMIUM) else None)
    if path is None:
        how = "run `make setup`" if os.geteuid() == 0 else "as root, run `apt-get install chromium`"
        pytest.fail(f"Debian's chromium is not installed (needed by the dashboard test): {how}")
    return path


def is_loopback(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme in ("data", "blob", "about"):
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Watch:
    """Everything the page does that must not happen (see the module docstring)."""

    def __init__(self, page: Page, allowed_statuses: tuple[int, ...] = ()) -> None:
        self.offsite: list[str] = []
        self.failed: list[str] = []
        self.console: list[str] = []
        self.requests: list[str] = []
        self.allowed = allowed_statuses
        page.on("requestfailed", lambda r: self.failed.append(f"{r.url}: {r.failure}"))
        page.on("response", self._response)
        page.on("console", self._console)
        page.on("pageerror", lambda e: self.console.append(f"uncaught: {e}"))

    def _response(self, r: Any) -> None:
        if r.status >= 400 and r.status not in self.allowed:
            self.failed.append(f"{r.url}: HTTP {r.status}")

    def _console(self, msg: Any) -> None:
        if msg.type == "error":
            self.console.append(msg.text)

    async def route(self, route: Route) -> None:
        url = route.request.url
        self.requests.append(url)
        if not is_loopback(url):
            self.offsite.append(url)
            await route.abort()
        else:
            await route.continue_()

    def check(self) -> None:
        assert not self.offsite, f"the page tried to leave the machine: {self.offsite}"
        assert not self.failed, f"requests failed: {self.failed}"


async def wait_for(page: Page, js: str, timeout_s: float = 15.0) -> Any:
    """Poll a JS expression until it is truthy; returns its value."""
    handle = await page.wait_for_function(js, timeout=timeout_s * 1000, polling=100)
    return await handle.json_value()


async def test_dashboard_in_headless_chromium(tokenizer: Tokenizer, tmp_path: Path) -> None:
    exe = chromium_path()
    c = await start_fake_cluster(
        prefills=[{"delay_s": 0.02}], decodes=[{"step_s": 0.01}, {"step_s": 0.01}]
    )
    router = Router(RouterConfig(model_name="smollm2", max_model_len=512), tokenizer, c.pool)
    app = build_app(router)
    app.state.monitor.interval_s = 0.5  # denser history so the test sees charts move quickly
    extra_server = None
    try:
        async with live_server(app) as url, async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=exe, args=CHROMIUM_ARGS, headless=True
            )
            try:
                page = await browser.new_page(viewport={"width": 1500, "height": 1500})
                watch = Watch(page)
                await page.route("**/*", watch.route)
                await page.goto(f"{url}/dashboard")
                await wait_for(page, "document.body.dataset.updated")
                rows = await page.eval_on_selector_all(
                    "#workers tbody tr", "rs => rs.map(r => r.dataset.worker)"
                )
                assert sorted(rows) == ["decode-0", "decode-1", "prefill-0"]
                assert await page.is_hidden("#banner")
                assert (
                    await page.evaluate("document.querySelectorAll('#requests tbody tr').length")
                    == 0
                )
                tokens_js = "charts['chart-tokens'].plot.data[1]"
                before = await page.evaluate(f"Math.max(0, ...{tokens_js}.map(v => v || 0))")
                assert before == 0
                canvas_before = await page.evaluate(
                    "document.querySelector('#chart-tokens canvas').toDataURL()"
                )

                # traffic: the charts, cards and request table must move
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    rs = await asyncio.gather(
                        *(
                            client.post(
                                "/v1/completions",
                                json={
                                    "prompt": [1, 2, 3 + i],
                                    "max_tokens": 30,
                                    "ignore_eos": True,
                                },
                            )
                            for i in range(6)
                        )
                    )
                    assert all(r.status_code == 200 for r in rs)
                await wait_for(page, f"Math.max(0, ...{tokens_js}.map(v => v || 0)) > 0")
                await wait_for(page, "charts['chart-ttft'].plot.data[1].some(v => v > 0)")
                canvas_after = await page.evaluate(
                    "document.querySelector('#chart-tokens canvas').toDataURL()"
                )
                assert canvas_after != canvas_before
                await wait_for(page, "document.querySelectorAll('#requests tbody tr').length >= 6")
                await page.click("#requests tbody tr a")
                await wait_for(
                    page, "document.querySelector('#record').textContent.includes('timeline')"
                )
                record = await page.text_content("#record")
                assert '"kv_path": "transferred"' in (record or "")

                # a worker joins: the table shows it
                extra = FakeDecode("decode-2", c.hub, kv_endpoint="kv-decode-2")
                c.hub.decoders[extra.kv_endpoint] = extra
                extra_server, addr = await _serve(extra, "decode")
                c.pool.upsert(WorkerInfo("decode-2", "decode", addr, extra.kv_endpoint, 256, 16))
                await wait_for(page, "document.querySelector('[data-worker=\"decode-2\"]')")

                # a worker is lost: the banner names it
                await c.kill("decode-1")
                banner = await wait_for(
                    page,
                    "!document.querySelector('#banner').hidden && "
                    "document.querySelector('#banner').textContent",
                )
                assert "decode-1" in banner and "lost" in banner
                kv_series = await page.evaluate("charts['chart-kv'].plot.series.length")
                assert kv_series == 1 + 4  # x + one line per worker ever seen

                shot = tmp_path / "dashboard.png"
                await page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000
                watch.check()
                assert not watch.console, f"console errors: {watch.console}"
                assert any("/vendor/uPlot.iife.min.js" in u for u in watch.requests)
            finally:
                await browser.close()
    finally:
        await app.state.monitor.stop()
        await drain_background()
        if extra_server is not None:
            await extra_server.stop(grace=None)
        await c.close()


async def test_dashboard_asks_for_the_api_key_once(tokenizer: Tokenizer) -> None:
    exe = chromium_path()
    c = await start_fake_cluster()
    router = Router(RouterConfig(model_name="smollm2", max_model_len=512), tokenizer, c.pool)
    app = build_app(router, api_key="s3cret")
    try:
        async with live_server(app) as url, async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=exe, args=CHROMIUM_ARGS, headless=True
            )
            try:
                page = await browser.new_page()
                watch = Watch(page, allowed_statuses=(401,))
                await page.route("**/*", watch.route)
                await page.goto(f"{url}/dashboard")
                await page.wait_for_selector("#key-form", state="visible")
                assert not await page.evaluate("document.body.dataset.updated || ''")
                await page.fill("#key-input", "s3cret")
                await page.click("#key-form button")
                await wait_for(page, "document.body.dataset.updated")
                assert await page.evaluate("sessionStorage.getItem('pdserve-api-key')") == "s3cret"
                assert await page.is_hidden("#key-form")
                rows = await page.eval_on_selector_all("#workers tbody tr", "rs => rs.length")
                assert rows == 2
                # later polls keep using the stored key: no new prompt
                await page.wait_for_timeout(2500)
                assert await page.is_hidden("#key-form")
                watch.check()
            finally:
                await browser.close()
    finally:
        await app.state.monitor.stop()
        await c.close()
