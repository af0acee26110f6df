"""Frozen configuration dataclasses, one per concern (DESIGN §1, STYLE 3).

Entry points take a config; small structures take plain numbers. Every config validates itself in
``__post_init__`` and raises :class:`ConfigError` (a ``ValueError``) with one line naming the field.
``ModelConfig.from_hf`` converts a Hugging Face ``config.json`` once; nothing below reads HF dicts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.cpu import bf16_is_fast


class ConfigError(ValueError):
    """A configuration value is missing, out of range or unsupported (one line, names the field)."""


# Ray refuses fractional resources finer than this
MIN_CPUS_PER_WORKER = 0.0001


def check_cpus_per_worker(cpus: float) -> None:
    """ConfigError naming --cpus-per-worker unless ``cpus`` (Ray CPUs of one worker) is finite
    and at least MIN_CPUS_PER_WORKER."""
    if not (math.isfinite(cpus) and cpus >= MIN_CPUS_PER_WORKER):
        raise ConfigError(
            f"--cpus-per-worker must be a number >= {MIN_CPUS_PER_WORKER} (Ray's resource "
            f"precision), got {cpus}"
        )


# --attention-backend choices; 'auto' is resolved per device by pdserve.attention.selector
ATTENTION_BACKENDS = ("auto", "torch_ref", "cpu_paged", "triton")

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (float32|bfloat16|float16). Raises ConfigError."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(
            f"dtype {dtype!r} is not supported; choose one of {sorted(_DTYPE_BYTES)}"
        ) from None


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` 'default' or 'llama3' (Llama 3.1 paper / HF config)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3", "linear"):
            raise ConfigError(f"rope_scaling.rope_type {self.rope_type!r} is not supported")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer (Llama family / Qwen2).

    ``architecture`` is the HF class name (e.g. ``LlamaForCausalLM``); the model registry maps it to
    an implementation. ``model_id`` names the weights for the KV layout handshake.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_id: str = "unknown"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"model config {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token per dtype byte: 2 * layers * kv_heads * head_dim (multiply by elem size)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], model_id: str = "unknown") -> ModelConfig:
        """Build from a parsed HF ``config.json``. Raises ConfigError naming a missing key."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures' entry")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            # transformers 5 writes `rope_parameters` {rope_theta, rope_type, ...} in place of
            # `rope_theta` + `rope_scaling`; read either spelling.
            params = cfg.get("rope_parameters") or {}
            rope = cfg.get("rope_scaling") or (
                params if params.get("rope_type", "default") != "default" else None
            )
            scaling = None
            if rope:
                rtype = rope.get("rope_type", rope.get("type", "default"))
                scaling = RopeScaling(
                    rope_type=rtype,
                    factor=float(rope.get("factor", 1.0)),
                    low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(
                        rope.get("original_max_position_embeddings", 8192)
                    ),
                )
            eos = cfg.get("eos_token_id")
            eos_ids: tuple[int, ...] = (
                () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
            )
            arch = str(archs[0])
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                rope_theta=float(cfg.get("rope_theta", params.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch.startswith("Qwen2"))),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                model_id=model_id,
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing required key {e.args[0]!r}") from None

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read a ``config.json`` file (or a directory holding one). Raises ConfigError."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"model config not found: {p}")
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        return cls.from_hf_dict(cfg, model_id=p.parent.name or "unknown")


@dataclass(frozen=True)
class LoadConfig:
    """Where the weights come from.

    ``model``: 'smollm2' (bundled GGUF), a HF directory, or a ``.gguf`` file.
    ``load_format``: 'auto' | 'safetensors' | 'gguf' | 'dummy' (random weights; needs a config).
    ``dtype``: 'auto' (bfloat16 on CUDA and on CPUs where bf16 is faster than fp32 — AMX, or
    avx512_bf16 on AMD; :func:`pdserve.cpu.bf16_is_fast` —, float32 on other CPUs; DESIGN §2) |
    float32 | bfloat16 | float16.
    ``attention_backend``: 'auto' (``triton`` on CUDA, ``cpu_paged`` on CPU, ``torch_ref`` when
    those cannot run) | torch_ref | cpu_paged | triton;
    :func:`pdserve.attention.selector.select_attention_backend` resolves it against the device and
    the model's head size when the model is built.
    ``torch_compile``: on CPU, compile the model's decoder with ``torch.compile`` at startup
    (pdserve/model/compile.py; elsewhere the model runs eagerly). Off for library use and tests;
    ``pdserve serve`` turns it on unless ``--enforce-eager`` is given (vLLM's flag).
    """

    model: str = "smollm2"
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    attention_backend: str = "auto"
    torch_compile: bool = False

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ConfigError(
                f"--load-format {self.load_format!r} is not one of auto|safetensors|gguf|dummy"
            )
        if self.dtype != "auto":
            dtype_bytes(self.dtype)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"--attention-backend {self.attention_backend!r} is not one of "
                f"{'|'.join(ATTENTION_BACKENDS)}"
            )

    @property
    def resolved_dtype(self) -> str:
        """The concrete dtype name after applying the per-device default."""
        if self.dtype != "auto":
            return self.dtype
        if self.device.startswith("cuda") or bf16_is_fast():
            return "bfloat16"
        return "float32"


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. ``num_blocks`` 0 = derive from ``kv_cache_memory_bytes``."""

    block_size: int = 16  # tokens per block
    num_blocks: int = 0
    kv_cache_memory_bytes: int = 2 * 1024**3
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(
                f"--block-size must be a positive power of two, got {self.block_size}"
            )
        if self.num_blocks < 0:
            raise ConfigError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if self.num_blocks == 0 and self.kv_cache_memory_bytes <= 0:
            raise ConfigError("kv_cache_memory_bytes must be > 0 when num_blocks is 0")

    def blocks_for(self, model: ModelConfig, dtype: str) -> int:
        """Number of blocks: ``num_blocks`` if set, else memory / bytes per block (seed formula)."""
        if self.num_blocks:
            return self.num_blocks
        per_block = model.kv_bytes_per_token * dtype_bytes(dtype) * self.block_size
        return max(1, self.kv_cache_memory_bytes // per_block)


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step batch limits (vLLM names).

    ``max_num_batched_tokens``: tokens computed in one forward (prefill chunks + decodes).
    ``max_num_seqs``: sequences in one step. ``max_model_len``: prompt + output tokens per request.
    ``long_prefill_token_threshold``: prompts with more tokens than this to compute are *long*; on
    a prefill worker and on a decode worker's prefill thread long prompts share at most this many
    tokens of any step, so shorter prompts never wait for a whole long one (0 =
    ``max_num_batched_tokens // 8``; the share is capped at the prefill step budget; see
    prefill_worker/scheduler.py); for a decode worker's local (unified-mode) prefills inside its
    decode steps (no prefill thread) it caps the prompt tokens of a step that also decodes (0 =
    ``max_num_batched_tokens // 2``).
    ``prefill_max_num_batched_tokens``: a prefill worker's tokens per step (0 = automatic: on a
    CPU ``min(max_num_batched_tokens, CPU_PREFILL_STEP_TOKENS)``, i.e. 320, elsewhere
    ``max_num_batched_tokens``; see :func:`prefill_step_budget`).
    ``local_prefill_thread``: a decode worker that prefills locally (unified mode) computes its
    prompts on a thread of their own, concurrently with the decode steps, each thread on half of
    the worker's CPU threads, instead of as chunks inside the decode steps (None = automatic: on
    where the worker has at least 2 threads; see decode_worker/engine.py; ``pdserve serve`` also
    turns it on for CPU decode workers with conditional disaggregation, see
    pdserve/commands/serve.py ``local_prefill_thread``).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    prefill_max_num_batched_tokens: int = 0
    local_prefill_thread: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}"
                )
        if self.prefill_max_num_batched_tokens < 0:
            raise ConfigError(
                "--prefill-max-num-batched-tokens must be >= 0 (0 = automatic), got "
                f"{self.prefill_max_num_batched_tokens}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "--long-prefill-token-threshold must be >= 0 (0 = automatic), got "
                f"{self.long_prefill_token_threshold}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "--max-num-batched-tokens must be >= --max-model-len when chunked prefill is off"
            )
        if (
            not self.enable_chunked_prefill
            and 0 < self.prefill_max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                "--prefill-max-num-batched-tokens must be >= --max-model-len when chunked "
                "prefill is off"
            )


CPU_PREFILL_STEP_TOKENS = 320
"""Default prefill step budget on a CPU (tokens): the default long-prompt share of a step (256 at
the default ``max_num_batched_tokens``) and the quarter more a long prompt's final chunk may take
(:func:`pdserve.engine.long_prompts.long_chunk`), so a prompt a little over 256 tokens runs in
one step instead of a full one and a small one that reads all the weights again (session 19: a
280-token bf16 prompt as 256 + 24 tokens took 105-123 + 45-47 ms on one core, whole ~120 ms;
served main workload, disaggregated bf16, 418.4 / 417.7 against 403.8-409.8 tok/s; session 19 of
docs/benchmarks.md). A decode worker's prefill thread (unified mode) takes the same budget, with
no long share and so no final-chunk rule; its 320-token steps were measured only in the session 19
suite run, not against 256. Why not much more: a CPU's cost per prompt token stops falling at a
few hundred tokens a step (measured, SmolLM2-135M bf16, one thread, compiled: 1.04 ms per token in
a 64-token step, 0.61 at 256, 0.49-0.57 at 512-2048), so a bigger step buys little throughput
while every prompt in it waits for the whole batch: a burst of eight 64-token prompts computed as
two 256-token steps instead of one 512-token step gets its first tokens ~25% sooner on average.
This is DistServe's point about prefill batching past the length where the device saturates (Zhong
et al., "DistServe", OSDI 2024, section 3.1). Measured in the serving suite's mixed workload
(eight closed-loop 64-token clients, alone and beside 1500-token prompts; session 6 of
docs/benchmarks.md), two interleaved pairs of 2048- against 256-token steps (both with 256-token
long chunks and the long/short alternation of prefill_worker/scheduler.py): short mean TTFT alone
205 / 231 -> 136 / 165 ms, beside the long prompts 249 / 330 -> 206 / 335 ms, the long prompts'
1.3-1.5 s either way. 128-token long chunks cut the mixed TTFT further (186-279 ms in other runs)
but make every prompt over 128 tokens long, so a burst of 280-token prompts ran 128 tokens a
step; that default was not kept."""


def prefill_step_budget(config: SchedulerConfig, device_type: str) -> int:
    """Tokens per prefill step (a prefill worker's, or a decode worker's prefill thread's) on
    ``device_type`` ('cpu', 'cuda', ...): ``prefill_max_num_batched_tokens`` when set, else on a CPU
    ``min(max_num_batched_tokens, CPU_PREFILL_STEP_TOKENS)``, elsewhere
    ``max_num_batched_tokens``. Without chunked prefill a prompt must fit one step, so the budget
    is then ``max_num_batched_tokens`` unless set explicitly."""
    if config.prefill_max_num_batched_tokens:
        return config.prefill_max_num_batched_tokens
    if device_type != "cpu" or not config.enable_chunked_prefill:
        return config.max_num_batched_tokens
    return min(config.max_num_batched_tokens, CPU_PREFILL_STEP_TOKENS)


@dataclass(frozen=True)
class TransferConfig:
    """KV transfer channel settings (DESIGN §5)."""

    backend: str = "torch_dist"  # torch_dist | loopback
    timeout_s: float = 30.0  # per send/recv
    checksum: bool = False
    # This worker's address on the KV network (its node IP): a decode worker advertises it in its
    # endpoint, a prefill worker's gloo socket listens on it.
    host: str = "127.0.0.1"
    bind_host: str | None = None  # where its TCPStore listens (None = host; 0.0.0.0 = all)
    auth_token: str | None = field(default=None, repr=False)  # internal token of KV handshakes

    def __post_init__(self) -> None:
        if self.backend not in ("torch_dist", "loopback"):
            raise ConfigError(f"transfer backend {self.backend!r} is not torch_dist|loopback")
        if self.timeout_s <= 0:
            raise ConfigError(f"transfer timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one worker engine (prefill or decode) needs."""

    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    # Multi-node (pdserve/net.py, pdserve/auth.py): where the worker binds (None = its node IP;
    # a wildcard binds all interfaces and advertises the node IP) and the internal token its
    # gRPC services and KV handshakes require (None = no check). Never printed.
    worker_host: str | None = None
    internal_token: str | None = field(default=None, repr=False)
    # --enable-fault-injection: the worker holds a FaultInjector (pdserve/engine/faults.py) that
    # /admin/faults can arm; its KV sender then checksums every payload. Off in production.
    enable_fault_injection: bool = False
    # --prefill-niceness: the niceness (0-19) a prefill worker's threads run at, so that where it
    # shares CPUs with decode workers the decode steps win the contended time (pdserve serve's
    # default: CPU_PREFILL_NICENESS on CPUs, else 0; pdserve/engine/actor.py).
    prefill_niceness: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.prefill_niceness <= 19:
            raise ConfigError(f"--prefill-niceness must be in [0, 19], got {self.prefill_niceness}")


# The CPU default of --prefill-niceness. A thread at niceness 5 weighs about a third of one at 0
# in Linux's scheduler (1.25^-5), so a busy prefill worker cedes most of a shared core to the
# decode step and the router. SmolLM2-135M fp32 on a 2-core Zen 1 EPYC, disaggregated, the mixed
# workload (short requests beside 1500-token prompts), two alternated pairs: the short requests'
# p99 ITL beside the long prompts 140 and 105 ms at 5 against 255 and 117 ms at 0, their mean
# TTFT 3.5 and 3.4 s against 3.1 and 3.1 s (docs/benchmarks.md, session 32).
CPU_PREFILL_NICENESS = 5


def default_prefill_niceness(device: str) -> int:
    """``--prefill-niceness`` when the flag is not given, for workers on ``device``:
    :data:`CPU_PREFILL_NICENESS` on a CPU (where the roles share cores), else 0 (a GPU worker's
    threads only feed its device)."""
    return CPU_PREFILL_NICENESS if device == "cpu" else 0


# The CPU default of --max-local-prefill-length: SmolLM2-135M fp32 on a 2-core Zen 1 EPYC, main
# workload (256 in / 128 out, concurrency 16), disaggregated: 512 with min_prefill_queue_tokens
# 512 gave 58-66 tok/s against 50-58 off (docs/benchmarks.md, sessions 27-28). That 512 counted
# the router's prompts in flight on top of the worker's report that held them; with each prompt
# counted once (router/pool.py, session 31) the same gate is about 256.
CPU_MAX_LOCAL_PREFILL_LENGTH = 512


def default_local_prefill_length(decode_devices: Iterable[str]) -> int:
    """``--max-local-prefill-length`` when the flag is not given, for decode workers on
    ``decode_devices`` ('cpu', 'cuda', 'cuda:1', ...): :data:`CPU_MAX_LOCAL_PREFILL_LENGTH`
    tokens when every one is a CPU worker, else 0 (off).

    On a CPU the prefill and decode workers are processes on the same few cores, and a decode
    worker at a small batch streams all its weights for a few rows a step; while prompts queue on
    the prefill worker it does more for the same time by prefilling short ones itself (on its
    prefill thread, beside the decode loop). A GPU decode worker's headroom has not been measured
    here, so it stays with NVIDIA Dynamo's default (conditional disaggregation opt-in)."""
    devices = list(decode_devices)
    if devices and all(d == "cpu" for d in devices):
        return CPU_MAX_LOCAL_PREFILL_LENGTH
    return 0


@dataclass(frozen=True)
class ServeConfig:
    """`pdserve serve`: the whole system on one machine (DESIGN §8)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    mode: str = "disaggregated"  # disaggregated | unified
    num_prefill_workers: int = 1
    num_decode_workers: int = 1
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 50051
    ray_address: str | None = None
    api_key: str | None = None
    served_model_name: str | None = None
    max_queued_requests: int = 256
    max_queued_tokens: int = 262144
    request_timeout_s: float = 600.0
    # open streaming (SSE) responses before new streaming requests get 429 (--max-concurrent-streams)
    max_concurrent_streams: int = 1024
    log_prompts: bool = False  # --log-prompts: prompt and output texts in the router's log
    chat_template: str | None = None  # template text replacing the model's (--chat-template)
    tool_call_parser: str | None = None  # 'hermes' | 'json'; None = chosen from the template
    # Conditional disaggregation (router/policy.py prefill_locally): prompts up to this many
    # tokens are prefilled on their decode worker while every prefill worker has at least
    # min_prefill_queue_tokens prompt tokens queued; 0 = always on a prefill worker. The flag's
    # default is chosen by default_local_prefill_length (on for CPU decode workers).
    max_local_prefill_length: int = 0
    min_prefill_queue_tokens: int = 256
    # seconds a stopping router (SIGTERM / Ctrl-C) lets requests in flight finish before it ends
    # the rest with a 503 'shutting down' (--drain-timeout); 0 = end them at once
    drain_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.drain_timeout_s < float("inf"):
            raise ConfigError(
                f"--drain-timeout must be a finite number of seconds >= 0, got {self.drain_timeout_s}"
            )
        if self.max_local_prefill_length < 0:
            raise ConfigError("--max-local-prefill-length must be >= 0 (0 turns it off)")
        if self.min_prefill_queue_tokens < 0:
            raise ConfigError("--min-prefill-queue-tokens must be >= 0")
        if self.max_concurrent_streams < 1:
            raise ConfigError("--max-concurrent-streams must be >= 1")
        for flag, port in (("--port", self.port), ("--grpc-port", self.grpc_port)):
            if not 0 <= port <= 65535:
                raise ConfigError(f"{flag} must be in 0..65535, got {port}")
        if self.mode not in ("disaggregated", "unified"):
            raise ConfigError(f"--mode {self.mode!r} is not disaggregated|unified")
        if self.num_decode_workers < 1:
            raise ConfigError("--num-decode-workers must be >= 1")
        if self.num_prefill_workers < 0:
            raise ConfigError("--num-prefill-workers must be >= 0")
