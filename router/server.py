"""Run both gateways (HTTP on uvicorn, gRPC) for one Router in the current event loop.

Ports are bound first, so a port conflict fails in a second with a message naming the flag,
before any worker is launched. While workers start, ``/health`` answers 503 and the gRPC health
service NOT_SERVING; both turn healthy once a decode worker registers. ``SIGINT``/``SIGTERM`` set
:attr:`Frontend.stopping`; the owner then shuts down in order (gateways, workers, Ray).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from pdserve.config import ServeConfig
from router.grpc_gateway import GrpcGateway
from router.http import ClusterControl, build_app
from router.http.header_limit import MAX_HEADER_BYTES
from router.http.stream_limit import DEFAULT_MAX_CONCURRENT_STREAMS
from router.serving import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendConfig:
    """Where to listen. ``api_key`` None = no authentication."""

    host: str = ServeConfig.host
    port: int = ServeConfig.port
    grpc_port: int = ServeConfig.grpc_port
    api_key: str | None = None
    log_level: str = "warning"
    enable_fault_injection: bool = False  # mounts /admin/faults over the cluster controller
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS  # open SSE responses
    max_header_bytes: int = MAX_HEADER_BYTES  # request target + headers (431; h11: 400)
    drain_timeout_s: float = ServeConfig.drain_timeout_s  # let requests in flight finish (s)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (the Frontend owns SIGINT/SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int, flag: str) -> socket.socket:
    """A listening TCP socket on ``host:port``. Raises RuntimeError naming ``flag`` when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"cannot listen on {host}:{port} ({e.strerror}); choose another {flag}"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Frontend:
    """HTTP + gRPC gateways for ``router``. ``control`` enables the /admin endpoints."""

    def __init__(
        self, router: Router, config: FrontendConfig, control: ClusterControl | None = None
    ) -> None:
        self.router = router
        self.config = config
        faults = control if config.enable_fault_injection else None
        self.app = build_app(
            router,
            api_key=config.api_key,
            control=control,
            fault_control=faults,  # type: ignore[arg-type]
            max_concurrent_streams=config.max_concurrent_streams,
            max_header_bytes=config.max_header_bytes,
        )
        self.grpc = GrpcGateway(
            router, host=config.host, port=config.grpc_port, api_key=config.api_key
        )
        self.stopping = asyncio.Event()
        self.stop_now = asyncio.Event()  # a second signal: end the drain
        self._http: _Uvicorn | None = None
        self._http_task: asyncio.Task[None] | None = None
        self.http_port = config.port

    async def start(self) -> None:
        """Bind both ports and start serving. Raises RuntimeError when a port is taken."""
        sock = bind_socket(self.config.host, self.config.port, "--port")
        self.http_port = int(sock.getsockname()[1])
        try:
            await self.grpc.start()
        except RuntimeError:
            sock.close()
            raise
        cfg = uvicorn.Config(
            self.app,
            log_level=self.config.log_level,
            access_log=False,
            lifespan="off",
            # h11, not "auto": httptools (picked when installed) does not bound a head's buffer
            http="h11",
            h11_max_incomplete_event_size=self.config.max_header_bytes,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=3,
        )
        self._http = _Uvicorn(cfg)
        self._http_task = asyncio.get_running_loop().create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            if self._http_task.done():
                self._http_task.result()
                raise RuntimeError("the HTTP server stopped during startup")
            await asyncio.sleep(0.01)
        self.app.state.monitor.ensure_started()  # dashboard history from the start
        self.capture_signals()

    def capture_signals(self) -> None:
        """Make SIGINT and SIGTERM set ``stopping``. Call again after ``ray.init()``: Ray installs
        its own SIGTERM handler (a fatal-signal stack dump) over ours."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        """The first signal starts the stop; a second one ends a drain at once."""
        (self.stop_now if self.stopping.is_set() else self.stopping).set()

    def release_signals(self) -> None:
        """Give SIGINT/SIGTERM back to Python (call last: a signal during shutdown is ignored)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)

    async def stop(self) -> None:
        """Stop both gateways, promptly. New requests get a 503 'shutting down' and /health
        (and gRPC health) turn unready at once; requests in flight may finish for
        ``drain_timeout_s`` (a second signal cuts it short); then the rest are ended with the
        same 503 (an SSE error event then ``[DONE]``, an error response, a gRPC GenerateError)
        and aborted on their workers (:meth:`Router.shut_down`), so the servers have nothing
        left to wait for. Their own grace periods (uvicorn's 3 s, gRPC's 1 s) only bound a
        request still being read or prepared. Idempotent."""
        self.router.stop_admitting()
        with contextlib.suppress(Exception):
            await self.grpc.health.enter_graceful_shutdown()
        await self._drain()
        ended = self.router.shut_down()
        if ended:
            log.info("shutting down: ended %d request(s) in flight", ended)
        await self.app.state.monitor.stop()
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._http_task, 10)
        with contextlib.suppress(Exception):
            await self.grpc.stop(1.0)

    async def _drain(self) -> None:
        """Wait up to ``drain_timeout_s`` for the requests in flight to finish (or a second
        signal)."""
        timeout_s = self.config.drain_timeout_s
        if timeout_s <= 0 or not self.router.num_open:
            return
        log.info(
            "shutting down: letting %d request(s) in flight finish for up to %.0f s (signal "
            "again to end them now)",
            self.router.num_open,
            timeout_s,
        )
        end = asyncio.get_running_loop().time() + timeout_s
        while self.router.num_open and not self.stop_now.is_set():
            left = end - asyncio.get_running_loop().time()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop_now.wait(), min(left, 0.05))

    def urls(self) -> dict[str, str]:
        """Where clients connect (``localhost`` for a wildcard host)."""
        host = self.config.host
        shown = "localhost" if host in ("0.0.0.0", "::", "") else host
        base = f"http://{shown}:{self.http_port}"
        return {
            "openai": f"{base}/v1",
            "grpc": f"{shown}:{self.grpc.port}",
            "metrics": f"{base}/metrics",
            "health": f"{base}/health",
            "dashboard": f"{base}/dashboard",
        }
