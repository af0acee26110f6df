"""Per-request records: the KV hand-off made visible (``GET /v1/requests/{id}``).

A :class:`RequestRecord` is one client request as the router saw it, keyed by its
``x-request-id`` (the client's header, or one the router made) and findable by its OpenAI
response id (``chatcmpl-...``, ``cmpl-...``) too. A client id is not unique: a request that
reuses the id of an earlier one (running or kept) gets a record of its own under the key
``<id>~2`` (``~3``, ...; ``~`` never occurs in an ``x-request-id``), and the plain id finds the
newest of them. It holds one :class:`SequenceTrace` per
sequence (``n`` x prompts), which the request lifecycle appends to at each step:

    admitted -> decode_reserved (D, blocks) -> prefill_started (P) -> prefill_done (cached tokens,
    queue/compute ms) -> kv_transfer (blocks, bytes, ms, path, outcome) -> first_token ->
    [preempted | migrated (cause) -> decode_reserved -> ...] -> finished | aborted | failed

A sequence prefilled on its decode worker (unified mode, or no prefill worker up) records
``kv_path = "local"`` and a ``local_prefill`` event: its KV was computed where it is used and no
transfer happened. A re-prefill after a preemption or a lost decode worker is recorded as such,
with its cause, so a recompute is never silent.

:class:`RequestLog` keeps live records until their last stream closes, then the last
``capacity`` finished ones in a ring (oldest dropped first). Times in a record are milliseconds
since the request arrived (``t_ms``), plus the arrival's Unix time (``created``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pdserve.v1 import worker_pb2 as pb

DEFAULT_CAPACITY = 1000  # finished requests kept for /v1/requests/{id}
_MAX_EVENTS = 256  # per sequence; a sequence re-placed more often keeps its last events


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class SequenceTrace:
    """The timeline of one sequence. ``origin``: the request's arrival, ``clock`` seconds."""

    def __init__(
        self,
        sequence_id: str,
        index: int,
        prompt_tokens: int,
        block_size: int,
        origin: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sequence_id = sequence_id
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.block_size = block_size
        self.origin = origin
        self.clock = clock
        self.state = "queued"
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.output_tokens = 0
        self.cached_tokens = 0
        self.prefill_worker: str | None = None
        self.decode_worker: str | None = None
        self.kv_path: str | None = None  # "transferred" | "local" once the first KV exists
        self.transfers: list[dict[str, Any]] = []
        self.replacements: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.first_token_ms: float | None = None
        self.end_ms: float | None = None
        self._prefill_started: float | None = None
        self._event("admitted", prompt_tokens=prompt_tokens)

    def _now_ms(self) -> float:
        return _ms(self.clock() - self.origin)

    def _event(self, name: str, **fields: Any) -> None:
        if len(self.timeline) >= _MAX_EVENTS:
            del self.timeline[1]  # keep "admitted"
        self.timeline.append({"t_ms": self._now_ms(), "event": name, **fields})

    # -- hooks called by router.lifecycle ---------------------------------------------------------

    def decode_reserved(
        self, worker_id: str, attempt_id: str, reserved_blocks: int, local: bool
    ) -> None:
        """A decode worker accepted the sequence and reserved ``reserved_blocks`` KV blocks."""
        self.state = "prefilling"
        self.decode_worker = worker_id
        self._event(
            "decode_reserved",
            worker=worker_id,
            attempt_id=attempt_id,
            kv_blocks=reserved_blocks,
            prefill="local" if local else "remote",
        )
        if local:
            # the decode worker computes this KV itself: nothing is transferred
            self.kv_path = self.kv_path or "local"
            self._event("local_prefill", worker=worker_id, kv_path="local")

    def prefill_started(self, worker_id: str, attempt_id: str, num_tokens: int) -> None:
        """A Prefill call of ``num_tokens`` tokens went to ``worker_id``."""
        self.prefill_worker = worker_id
        self._prefill_started = self.clock()
        self._event("prefill_started", worker=worker_id, attempt_id=attempt_id, tokens=num_tokens)

    def prefill_done(self, worker_id: str, resp: pb.PrefillResponse, num_tokens: int) -> None:
        """The Prefill call returned: token 1, prefix-cache hits, and the KV transfer record."""
        if not self.transfers:
            self.cached_tokens = resp.cached_tokens
        self._event(
            "prefill_done",
            worker=worker_id,
            cached_tokens=resp.cached_tokens,
            queue_ms=round(resp.queue_ms, 3),
            compute_ms=round(resp.compute_ms, 3),
        )
        rec = resp.transfer
        outcome = rec.outcome or "ok"
        path = rec.path or "transferred"
        blocks = -(-num_tokens // self.block_size)
        transfer = {
            "prefill_worker": worker_id,
            "decode_worker": self.decode_worker,
            "transfer_id": rec.transfer_id,
            "path": path,
            "outcome": outcome,
            "tokens": num_tokens,
            "blocks": blocks,
            "bytes": rec.bytes,
            # NOTE: the KV bytes one full block holds (block_size tokens), a constant of the
            # model, not bytes / blocks: the payload [layers, 2, tokens, kv_heads, head_dim]
            # carries the prompt's tokens only, so a partial last block sends less than a
            # block's worth. None when nothing moved (a failed or dropped transfer).
            "bytes_per_block": (
                rec.bytes // num_tokens * self.block_size if num_tokens and rec.bytes else None
            ),
            "ms": round(rec.ms, 3),
            "error": rec.error or None,
        }
        self.transfers.append(transfer)
        if outcome == "ok" and self.kv_path is None:
            self.kv_path = path
        event = "kv_transfer" if outcome == "ok" else "kv_transfer_failed"
        self._event(event, **{k: v for k, v in transfer.items() if k != "error" or v})

    def prefill_failed(self, worker_id: str, code: str, details: str) -> None:
        """The Prefill call failed (it will be retried elsewhere or the sequence fails)."""
        self._event("prefill_failed", worker=worker_id, code=code, cause=details)

    def first_token(self) -> None:
        """Token 1 reached the router."""
        if self.first_token_ms is None:
            self.first_token_ms = self._now_ms()
            self.state = "decoding"
            self._event("first_token")

    def replaced(self, kind: str, worker_id: str, cause: str, output_tokens: int) -> None:
        """The sequence left ``worker_id`` (``kind`` 'preemption' | 'migration') and will be
        re-prefilled (prompt + ``output_tokens`` generated tokens recomputed) elsewhere."""
        entry = {
            "t_ms": self._now_ms(),
            "kind": kind,
            "worker": worker_id,
            "cause": cause,
            "output_tokens": output_tokens,
        }
        self.replacements.append(entry)
        self.state = "migrating"
        self._event("preempted" if kind == "preemption" else "migrated", **entry)

    def ended(self, state: str, finish_reason: str | None, output_tokens: int, error: str) -> None:
        """Terminal state ('finished' | 'aborted' | 'failed')."""
        self.state = state
        self.finish_reason = finish_reason
        self.output_tokens = output_tokens
        self.error = error or None
        self.end_ms = self._now_ms()
        fields: dict[str, Any] = {"output_tokens": output_tokens}
        if finish_reason:
            fields["finish_reason"] = finish_reason
        if error:
            fields["cause"] = error
        self._event(state, **fields)

    # -- views ---------------------------------------------------------------------------------------

    def phases_ms(self) -> dict[str, float | None]:
        """Queue (arrival -> first decode reservation), prefill (incl. KV transfer), decode."""
        t = {e["event"]: e["t_ms"] for e in reversed(self.timeline)}  # first occurrence wins
        placed = t.get("decode_reserved")
        first = self.first_token_ms
        transfer = sum(x["ms"] for x in self.transfers)
        return {
            "queue": placed,
            "prefill": None if placed is None or first is None else round(first - placed, 3),
            "kv_transfer": round(transfer, 3) if self.transfers else None,
            "decode": None if first is None or self.end_ms is None else self.end_ms - first,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON form (see the module docstring)."""
        ok = [x for x in self.transfers if x["outcome"] == "ok" and x["path"] != "local"]
        return {
            "sequence_id": self.sequence_id,
            "index": self.index,
            "state": self.state,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
            "kv_path": self.kv_path,
            "kv_blocks_sent": sum(x["blocks"] for x in ok),
            "kv_bytes_sent": sum(x["bytes"] for x in ok),
            "ttft_ms": self.first_token_ms,
            "phases_ms": self.phases_ms(),
            "transfers": list(self.transfers),
            "preemptions": sum(r["kind"] == "preemption" for r in self.replacements),
            "migrations": sum(r["kind"] == "migration" for r in self.replacements),
            "replacements": list(self.replacements),
            "timeline": list(self.timeline),
        }


class RequestRecord:
    """One client request: its id(s), outcome and sequences."""

    def __init__(
        self,
        request_id: str,
        arrival: float,
        prompt_tokens: int,
        n: int,
        key: str | None = None,
        scope: object | None = None,
    ) -> None:
        self.request_id = request_id
        self.key = request_id if key is None else key  # unique among the log's records
        self.scope = scope  # the client request (HTTP) this record belongs to
        self.response_ids: list[str] = []
        self.arrival = arrival  # time.monotonic() seconds
        self.created = time.time()
        self.prompt_tokens = prompt_tokens
        self.n = n
        self.sequences: list[SequenceTrace] = []
        self.open_streams = 0
        self.rejected: str | None = None  # why admission refused it

    def add_sequence(
        self, sequence_id: str, index: int, prompt_tokens: int, block_size: int
    ) -> SequenceTrace:
        """A new trace for one of this request's sequences (``block_size`` in tokens)."""
        trace = SequenceTrace(sequence_id, index, prompt_tokens, block_size, self.arrival)
        self.sequences.append(trace)
        return trace

    @property
    def status(self) -> str:
        """'rejected' | 'running' | 'failed' | 'aborted' | 'finished'."""
        if self.rejected is not None:
            return "rejected"
        states = {s.state for s in self.sequences}
        if self.open_streams or not states <= {"finished", "aborted", "failed"}:
            return "running"
        for s in ("failed", "aborted"):
            if s in states:
                return s
        return "finished"

    def summary(self) -> dict[str, Any]:
        """The short form the dashboard lists (no timeline)."""
        seqs = self.sequences
        ttft = [s.first_token_ms for s in seqs if s.first_token_ms is not None]
        ends = [s.end_ms for s in seqs if s.end_ms is not None]
        paths = {s.kv_path for s in seqs if s.kv_path}
        return {
            "id": self.key,
            "request_id": self.request_id,
            "response_ids": list(self.response_ids),
            "created": round(self.created, 3),
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": sum(s.output_tokens for s in seqs),
            "cached_tokens": max((s.cached_tokens for s in seqs), default=0),
            "num_sequences": len(seqs),
            "ttft_ms": min(ttft) if ttft else None,
            "e2e_ms": max(ends) if ends and len(ends) == len(seqs) else None,
            "prefill_workers": sorted({s.prefill_worker for s in seqs if s.prefill_worker}),
            "decode_workers": sorted({s.decode_worker for s in seqs if s.decode_worker}),
            "kv_path": paths.pop() if len(paths) == 1 else ("mixed" if paths else None),
            "kv_bytes_sent": sum(x["kv_bytes_sent"] for x in (s.to_dict() for s in seqs)),
            "preemptions": sum(r["kind"] == "preemption" for s in seqs for r in s.replacements),
            "migrations": sum(r["kind"] == "migration" for s in seqs for r in s.replacements),
            "phases_ms": seqs[0].phases_ms() if seqs else None,
            "rejected": self.rejected,
        }

    def to_dict(self) -> dict[str, Any]:
        """The full record: summary plus every sequence's timeline."""
        return {**self.summary(), "sequences": [s.to_dict() for s in self.sequences]}


class RequestLog:
    """Live records plus a bounded ring of the last ``capacity`` (>= 1) finished ones."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._live: dict[str, RequestRecord] = {}  # by key
        self._done: OrderedDict[str, RequestRecord] = OrderedDict()  # by key
        self._aliases: dict[str, str] = {}  # response id -> key
        self._newest: dict[str, str] = {}  # request id -> key of its newest record

    def open(
        self,
        request_id: str,
        response_id: str,
        arrival: float,
        prompt_tokens: int,
        n: int,
        scope: object | None = None,
    ) -> RequestRecord:
        """The live record for ``request_id`` with one more open stream: the one a
        multi-prompt request shares (same ``scope``, the client request's
        :func:`~router.request_id.current_request_scope`), else a new one."""
        rec = self._live_record(request_id, scope)
        if rec is None:
            rec = RequestRecord(request_id, arrival, 0, n, self._new_key(request_id), scope)
            self._live[rec.key] = rec
            self._newest[request_id] = rec.key
        rec.prompt_tokens += prompt_tokens
        rec.open_streams += 1
        self._alias(rec, response_id)
        return rec

    def reject(
        self,
        request_id: str,
        response_id: str,
        prompt_tokens: int,
        why: str,
        scope: object | None = None,
    ) -> None:
        """Keep a record of a request admission refused (it holds no sequence)."""
        live = self._live_record(request_id, scope)
        if live is not None:  # a later prompt of a multi-prompt request
            live.rejected = why
            return
        rec = RequestRecord(
            request_id, time.monotonic(), prompt_tokens, 0, self._new_key(request_id), scope
        )
        rec.rejected = why
        self._newest[request_id] = rec.key
        self._alias(rec, response_id)
        self._retire(rec)

    def close(self, rec: RequestRecord) -> None:
        """One of the record's streams closed; the last one moves it to the ring."""
        rec.open_streams -= 1
        if rec.open_streams <= 0 and self._live.get(rec.key) is rec:
            del self._live[rec.key]
            self._retire(rec)

    def _live_record(self, request_id: str, scope: object | None) -> RequestRecord | None:
        key = self._newest.get(request_id)
        rec = self._live.get(key) if key is not None else None
        return rec if rec is not None and rec.scope is scope else None

    def _new_key(self, request_id: str) -> str:
        key, k = request_id, 1
        while key in self._live or key in self._done:
            k += 1
            key = f"{request_id}~{k}"
        return key

    def _alias(self, rec: RequestRecord, response_id: str) -> None:
        if response_id and response_id != rec.key and response_id not in rec.response_ids:
            rec.response_ids.append(response_id)
            self._aliases[response_id] = rec.key

    def _retire(self, rec: RequestRecord) -> None:
        self._done.pop(rec.key, None)
        self._done[rec.key] = rec
        while len(self._done) > self.capacity:
            _, old = self._done.popitem(last=False)
            for alias in old.response_ids:
                if self._aliases.get(alias) == old.key:
                    del self._aliases[alias]
            if self._newest.get(old.request_id) == old.key:
                del self._newest[old.request_id]

    def get(self, record_id: str) -> RequestRecord | None:
        """The record with this response id, request id (its newest record) or key, live or
        finished."""
        key = self._aliases.get(record_id) or self._newest.get(record_id, record_id)
        return self._live.get(key) or self._done.get(key)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def recent(self, limit: int) -> list[RequestRecord]:
        """Up to ``limit`` records, newest arrival first (running ones included)."""
        records = list(self._live.values()) + list(self._done.values())
        records.sort(key=lambda r: r.created, reverse=True)
        return records[:limit]
