"""Fake prefill and decode workers: real grpc.aio servers speaking worker.proto, no model.

Tokens are a deterministic function of the sequence so far (:func:`next_token`), or a script, so
disaggregated, unified and migrated runs of the same request must produce identical outputs. KV
"transfer" is an in-process hand-off through :class:`KVHub`. Faults are injected by constructor
arguments (budgets that count down), never by environment variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.worker_info import WorkerInfo
from router.pool import WorkerPool

EOS = 2
VOCAB = 49152


def next_token(tokens: Sequence[int], num_output: int, script: Sequence[int] | None) -> int:
    """Token at output position ``num_output`` after ``tokens`` (prompt + outputs so far).

    With a ``script``: its entry, or EOS past its end. Without: a hash of the last tokens in
    [1000, 31000) (never EOS).
    """
    if script is not None:
        return script[num_output] if num_output < len(script) else EOS
    a = tokens[-1]
    b = tokens[-2] if len(tokens) > 1 else 0
    return 1000 + (a * 31 + b * 17 + len(tokens) * 7) % 30000


def blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVHub:
    """Where fake prefill workers "send" KV: kv_endpoint -> decode servicer."""

    def __init__(self) -> None:
        self.decoders: dict[str, FakeDecode] = {}

    def deliver(self, endpoint: str, transfer_id: int, token: int) -> bool:
        dec = self.decoders.get(endpoint)
        return dec is not None and dec.deliver(transfer_id, token)


@dataclass
class _Held:
    """One decode reservation / running sequence."""

    request_id: str
    blocks: int
    kv: asyncio.Future[int]
    task: asyncio.Task[object] | None = None


@dataclass
class FakeDecode(pb_grpc.DecodeServiceServicer):
    """DecodeService with a block budget, per-step delay and fault budgets.

    ``preempt_budget``: the next N sequences that reach ``preempt_at`` output tokens on this
    worker are preempted. ``break_budget``: the next N that reach ``break_at`` tokens see the
    stream fail (UNAVAILABLE). ``reject_budget``: the next N Decode calls get RESOURCE_EXHAUSTED.
    ``accept_delay_s``: delay before Accepted; ``stats_delay_s``: before GetStats answers.
    Running out of blocks while decoding preempts.
    """

    worker_id: str
    hub: KVHub
    num_blocks: int = 256
    block_size: int = 16
    step_s: float = 0.002
    script: Sequence[int] | None = None
    preempt_budget: int = 0
    preempt_at: int = 2
    break_budget: int = 0
    break_at: int = 2
    reject_budget: int = 0
    accept_delay_s: float = 0.0
    stats_delay_s: float = 0.0
    kv_endpoint: str = ""
    held: dict[str, _Held] = field(default_factory=dict)
    requests: list[pb.DecodeRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    num_preemptions: int = 0
    num_finished: int = 0
    _transfer_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _by_transfer: dict[int, _Held] = field(default_factory=dict)

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - sum(h.blocks for h in self.held.values())

    def deliver(self, transfer_id: int, token: int) -> bool:
        h = self._by_transfer.pop(transfer_id, None)
        if h is None or h.kv.done():
            return False
        h.kv.set_result(token)
        return True

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self.requests.append(request)
        if self.accept_delay_s:
            await asyncio.sleep(self.accept_delay_s)
        if self.reject_budget > 0:
            self.reject_budget -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "injected: no KV room")
        prompt = list(request.prompt_token_ids)
        need = blocks(len(prompt) + 1, self.block_size)
        if need > self.free_blocks:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free KV blocks")
        rid = request.request_id
        held = _Held(rid, need, asyncio.get_running_loop().create_future(), asyncio.current_task())
        self.held[rid] = held
        transfer_id = next(self._transfer_ids)
        self._by_transfer[transfer_id] = held
        try:
            yield pb.DecodeEvent(
                accepted=pb.Accepted(
                    transfer_id=transfer_id,
                    kv_endpoint=self.kv_endpoint,
                    decode_worker_id=self.worker_id,
                    num_reserved_blocks=need,
                    # a local prefill's prefix-cache hit, as FakePrefill reports a remote one
                    cached_tokens=len(prompt) // 16 * 16 // 2 if request.prefill_locally else 0,
                )
            )
            n_out = request.num_output_tokens
            orig_prompt_len = len(prompt) - n_out
            seq = prompt
            max_tokens = request.sampling.max_tokens
            if request.prefill_locally:
                await asyncio.sleep(self.step_s)
                tok = next_token(seq, n_out, self.script)
                seq = seq + [tok]
                yield pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.TokenLogprob(token_id=tok)]))
            else:
                try:
                    tok = await asyncio.wait_for(held.kv, request.kv_timeout_s or 5.0)
                except asyncio.TimeoutError:
                    yield pb.DecodeEvent(
                        error=pb.ErrorEvent(
                            code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], message="KV timeout"
                        )
                    )
                    return
                seq = seq + [tok]
            while True:
                n_out = len(seq) - orig_prompt_len
                stop_ids = request.sampling.stop_token_ids
                if (tok == EOS and not request.sampling.ignore_eos) or tok in stop_ids:
                    self.num_finished += 1
                    yield pb.DecodeEvent(
                        finished=pb.Finished(reason="stop", num_output_tokens=n_out)
                    )
                    return
                if n_out >= max_tokens:
                    self.num_finished += 1
                    yield pb.DecodeEvent(
                        finished=pb.Finished(reason="length", num_output_tokens=n_out)
                    )
                    return
                out_ids = seq[orig_prompt_len:]
                if self.preempt_budget > 0 and n_out >= self.preempt_at:
                    self.preempt_budget -= 1
                    self.num_preemptions += 1
                    yield pb.DecodeEvent(
                        preempted=pb.Preempted(output_token_ids=out_ids, reason="injected")
                    )
                    return
                if self.break_budget > 0 and n_out >= self.break_at:
                    self.break_budget -= 1
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: stream broke")
                grow = blocks(len(seq) + 1, self.block_size) - held.blocks
                if grow > 0:
                    if grow > self.free_blocks:
                        self.num_preemptions += 1
                        yield pb.DecodeEvent(
                            preempted=pb.Preempted(output_token_ids=out_ids, reason="no free KV")
                        )
                        return
                    held.blocks += grow
                await asyncio.sleep(self.step_s)
                tok = next_token(seq, n_out, self.script)
                seq = seq + [tok]
                lp = pb.TokenLogprob(token_id=tok, logprob=-0.5)
                if request.sampling.top_logprobs:
                    lp.top_token_ids.extend([tok, tok + 1])
                    lp.top_logprobs.extend([-0.5, -1.5])
                yield pb.DecodeEvent(tokens=pb.Tokens(tokens=[lp]))
        finally:
            self.held.pop(rid, None)
            self._by_transfer.pop(transfer_id, None)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self.aborted.append(request.request_id)
        held = self.held.pop(request.request_id, None)
        if held is not None and held.task is not None:
            held.task.cancel()
        return pb.AbortResponse(found=held is not None)

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if self.stats_delay_s:
            await asyncio.sleep(self.stats_delay_s)
        waiting = sum(1 for h in self.held.values() if not h.kv.done())
        return pb.DecodeStats(
            worker_id=self.worker_id,
            num_running=len(self.held) - waiting,
            num_waiting_for_kv=waiting,
            kv_blocks_free=self.free_blocks,
            kv_blocks_total=self.num_blocks,
            num_preemptions=self.num_preemptions,
            num_finished=self.num_finished,
            kv_endpoint=self.kv_endpoint,
        )


@dataclass
class FakePrefill(pb_grpc.PrefillServiceServicer):
    """PrefillService: samples token 1 with :func:`next_token` and hands it to the target.

    ``fail_budget``: the next N Prefill calls fail with ``fail_code``. ``delay_s``: compute time.
    ``stall_budget``: the next N Prefill calls never finish (until the caller cancels them).
    ``reply_delay_s``: time between delivering the KV and answering the call.
    ``transfer_outcome``: what the transfer record says (a non-"ok" value delivers nothing).
    ``queue``: PrefillStats fields GetStats reports beside ``num_running`` (e.g. a backlog).
    """

    worker_id: str
    hub: KVHub
    script: Sequence[int] | None = None
    fail_budget: int = 0
    fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    delay_s: float = 0.001
    stall_budget: int = 0
    reply_delay_s: float = 0.0
    transfer_outcome: str = "ok"
    requests: list[pb.PrefillRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    cancelled: list[str] = field(default_factory=list)
    queue: dict[str, int] = field(default_factory=dict)

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self.requests.append(request)
        if self.fail_budget > 0:
            self.fail_budget -= 1
            await context.abort(self.fail_code, "injected prefill failure")
        self.running.add(request.request_id)
        try:
            if self.stall_budget > 0:
                self.stall_budget -= 1
                await asyncio.Event().wait()
            await asyncio.sleep(self.delay_s)
            prompt = list(request.prompt_token_ids)
            tok = next_token(prompt, request.num_output_tokens, self.script)
            ok = self.transfer_outcome == "ok"
            if ok:
                ok = self.hub.deliver(request.target.kv_endpoint, request.target.transfer_id, tok)
            if self.reply_delay_s:
                await asyncio.sleep(self.reply_delay_s)
            first = pb.TokenLogprob(token_id=tok, logprob=-0.25)
            if request.sampling.top_logprobs:
                first.top_token_ids.extend([tok, tok + 1])
                first.top_logprobs.extend([-0.25, -2.0])
            return pb.PrefillResponse(
                request_id=request.request_id,
                token=first,
                cached_tokens=len(prompt) // 16 * 16 // 2,
                transfer=pb.TransferRecord(
                    transfer_id=request.target.transfer_id,
                    bytes=len(prompt) * 100,
                    ms=0.1,
                    outcome="ok" if ok else self.transfer_outcome,
                    path="transferred",
                ),
            )
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.running.discard(request.request_id)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self.aborted.append(request.request_id)
        return pb.AbortResponse(found=request.request_id in self.running)

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return pb.PrefillStats(
            worker_id=self.worker_id, num_running=len(self.running), **self.queue
        )


@dataclass
class FakeCluster:
    """Running fake servers registered in a WorkerPool. Build with :func:`start_fake_cluster`."""

    pool: WorkerPool
    hub: KVHub
    prefills: list[FakePrefill]
    decodes: list[FakeDecode]
    servers: dict[str, grpc.aio.Server]

    async def kill(self, worker_id: str) -> None:
        """Stop a worker's server at once (in-flight calls fail)."""
        await self.servers[worker_id].stop(grace=None)

    async def close(self) -> None:
        await self.pool.close()
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                await server.stop(grace=None)


async def _serve(servicer: object, role: str) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    if role == "prefill":
        pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    else:
        pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def start_fake_cluster(
    prefills: Sequence[FakePrefill | dict[str, object]] = ({},),
    decodes: Sequence[FakeDecode | dict[str, object]] = ({},),
    stats_interval_s: float = 0.05,
) -> FakeCluster:
    """Start fake workers (dicts are FakePrefill/FakeDecode keyword arguments) and a pool."""
    hub = KVHub()
    pool = WorkerPool(stats_interval_s=stats_interval_s)
    servers: dict[str, grpc.aio.Server] = {}
    decs: list[FakeDecode] = []
    pres: list[FakePrefill] = []
    for i, d in enumerate(decodes):
        dec = d if isinstance(d, FakeDecode) else FakeDecode(f"decode-{i}", hub, **d)  # type: ignore[arg-type]
        server, addr = await _serve(dec, "decode")
        dec.kv_endpoint = f"kv-{dec.worker_id}"
        hub.decoders[dec.kv_endpoint] = dec
        servers[dec.worker_id] = server
        pool.upsert(
            WorkerInfo(
                dec.worker_id, "decode", addr, dec.kv_endpoint, dec.num_blocks, dec.block_size
            )
        )
        decs.append(dec)
    for i, p in enumerate(prefills):
        pre = p if isinstance(p, FakePrefill) else FakePrefill(f"prefill-{i}", hub, **p)  # type: ignore[arg-type]
        server, addr = await _serve(pre, "prefill")
        servers[pre.worker_id] = server
        pool.upsert(WorkerInfo(pre.worker_id, "prefill", addr))
        pres.append(pre)
    await pool.poll_once()
    pool.start()
    return FakeCluster(pool, hub, pres, decs, servers)


class FakeWorkerActor:
    """Stands in for PrefillActor / DecodeActor in Ray tests (same constructor and methods).

    The role comes from the worker id prefix. Decode actors prefill locally (there is no shared
    KV hub across processes), so only the unified path generates tokens here.
    """

    def __init__(
        self,
        worker_id: str,
        config: object,
        num_cpus: float = 1.0,
        allow_local_prefill: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.role = "decode" if worker_id.startswith("decode") else "prefill"
        self.allow_local_prefill = allow_local_prefill
        self.server: grpc.aio.Server | None = None

    async def start(self) -> WorkerInfo:
        import os

        hub = KVHub()
        if self.role == "decode":
            servicer: object = FakeDecode(self.worker_id, hub, kv_endpoint=f"kv-{self.worker_id}")
        else:
            servicer = FakePrefill(self.worker_id, hub)
        self.server, addr = await _serve(servicer, self.role)
        kv = f"kv-{self.worker_id}" if self.role == "decode" else ""
        return WorkerInfo(self.worker_id, self.role, addr, kv, 256, 16, os.getpid())

    async def ping(self) -> bool:
        return True

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

    async def crash(self) -> None:
        """Exit the process the way a crash does (Ray restarts the actor)."""
        import os

        os._exit(1)


class SlowStopWorkerActor(FakeWorkerActor):
    """A FakeWorkerActor whose ``stop()`` returns ``STOP_S`` seconds after its server stopped,
    as a real worker's does (its in-flight calls get a grace period, then the engine stops)."""

    STOP_S = 0.5

    async def stop(self) -> None:
        await super().stop()
        await asyncio.sleep(self.STOP_S)


class SlowStartWorkerActor(FakeWorkerActor):
    """A FakeWorkerActor whose ``start()`` takes ``START_S`` seconds, as loading a model does, and
    answers pings meanwhile (it is an async actor); ``num_starts()`` counts the start calls."""

    START_S = 2.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.starts = 0
        self.started_at = 0.0

    async def start(self) -> WorkerInfo:
        self.starts += 1
        self.started_at = time.time()
        await asyncio.sleep(self.START_S)
        return await super().start()

    async def num_starts(self) -> int:
        return self.starts

    async def start_time(self) -> float:
        """``time.time()`` when ``start()`` was last entered."""
        return self.started_at


class SlowerStartWorkerActor(SlowStartWorkerActor):
    """A SlowStartWorkerActor that takes five seconds to start."""

    START_S = 5.0


class LoadingForeverWorkerActor(SlowStartWorkerActor):
    """A SlowStartWorkerActor that takes five minutes to start."""

    START_S = 300.0


class FailingStartWorkerActor(FakeWorkerActor):
    """A FakeWorkerActor whose ``start()`` fails at once, as a worker that cannot load its model."""

    async def start(self) -> WorkerInfo:
        raise RuntimeError(f"{self.worker_id}: cannot load the model")
