"""A scripted fake OpenAI-compatible streaming server with known per-token delays.

Run as a separate process (so its timing is not disturbed by the benchmark's event loop):

    python fake_openai.py SCRIPT.json [PORT]  # prints "PORT <n>" once listening on 127.0.0.1

SCRIPT.json maps a case id to its behaviour; a request picks its case from the first word of its
prompt (completions) or last message (chat), ``case:<id>``; anything else uses case ``default``.

    {"ttft_ms": 40, "itl_ms": [10, 20, ...],   # first chunk after ttft_ms, then one per gap
     "usage_tokens": null,     # completion_tokens to report (default: number of chunks)
     "prompt_tokens": 7,       # usage.prompt_tokens
     "usage": true,            # send the final usage chunk
     "fail": null}             # "http_500" | "drop" (close mid-stream) | "error_event" | "empty"

Chunk k (0-based) is written at ``t_request + ttft_ms + sum(itl_ms[:k])`` (absolute deadlines, so
sleep error does not accumulate); ``time.sleep`` in a thread per request is precise to well under
a millisecond, unlike an event loop whose timers round to milliseconds. ``GET /v1/models`` lists
the model ``fake-model``; ``GET /health`` answers 200. PORT (default 0) picks the port.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SCRIPT: dict[str, dict[str, Any]] = {}
# One record per POST: case id, receipt time and each chunk's write time (perf_counter seconds,
# CLOCK_MONOTONIC on Linux, so comparable with the benchmark process's clock). GET /log returns it.
LOG: list[dict[str, Any]] = []
LOG_LOCK = threading.Lock()


def _case_id(body: dict[str, Any]) -> str:
    if "messages" in body:
        text = str(body["messages"][-1].get("content", ""))
    else:
        text = str(body.get("prompt", ""))
    first = text.split()[0] if text.split() else ""
    key = first[len("case:") :] if first.startswith("case:") else "default"
    return key if key in SCRIPT else "default"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # Small SSE writes must leave at once: no Nagle coalescing behind delayed ACKs.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        return

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (stdlib name)
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        elif self.path == "/health":
            self._json(200, {})
        elif self.path == "/log":
            with LOG_LOCK:
                self._json(200, LOG)
        else:
            self._json(404, {"error": {"message": "not found"}})

    def _chunk(self, payload: str) -> None:
        data = payload.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self) -> None:  # noqa: N802 (stdlib name)
        t0 = time.perf_counter()
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length))
        case_id = _case_id(body)
        case = SCRIPT.get(case_id, {"ttft_ms": 5, "itl_ms": [1, 1]})
        record: dict[str, Any] = {"case": case_id, "t_request": t0, "chunk_times": []}
        with LOG_LOCK:
            LOG.append(record)
        chat = self.path.endswith("/chat/completions")
        if case.get("fail") == "http_500":
            self._json(500, {"error": {"message": "scripted failure"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        gaps = [float(g) for g in case.get("itl_ms", [])]
        n_chunks = 0 if case.get("fail") == "empty" else len(gaps) + 1
        deadline = t0 + float(case.get("ttft_ms", 0.0)) / 1000.0
        for k in range(n_chunks):
            if k:
                deadline += gaps[k - 1] / 1000.0
            delay = deadline - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            if case.get("fail") == "drop" and k == n_chunks // 2:
                self.close_connection = True
                self.wfile.write(b"5\r\ndata:")  # a truncated chunk, then the socket closes
                self.wfile.flush()
                return
            if case.get("fail") == "error_event" and k == n_chunks // 2:
                self._chunk('data: {"error": {"message": "scripted mid-stream error"}}\n\n')
                break
            last = k == n_chunks - 1
            text = f"tok{k} "
            if chat:
                delta = {"content": text} if k else {"role": "assistant", "content": text}
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text}
            choice["finish_reason"] = "length" if last else None
            payload = "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"
            record["chunk_times"].append(time.perf_counter())
            self._chunk(payload)
        if case.get("usage", True) and case.get("fail") not in ("error_event",):
            usage = {
                "prompt_tokens": int(case.get("prompt_tokens", 7)),
                "completion_tokens": int(case.get("usage_tokens") or n_chunks),
            }
            self._chunk("data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n")
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default backlog of 5 drops concurrent connects (1 s SYN retry)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients closing idle keep-alive connections reset them: not an error worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def main() -> None:
    # Ctrl-C ends it even when started from a shell that ignores SIGINT in background jobs
    # (a child inherits that, and Python then installs no KeyboardInterrupt handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with open(sys.argv[1]) as f:
        SCRIPT.update(json.load(f))
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    server = Server(("127.0.0.1", port), Handler)
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
