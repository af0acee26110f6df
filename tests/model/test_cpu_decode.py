"""The fused CPU decode step (pdserve/model/cpu_decode.py): same logits and KV as the model's
forward, the same greedy tokens, and it runs exactly where it should."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch
from tiny_models import TINY, gguf_values

from decode_worker.offline import OfflineEngine
from pdserve.config import CacheConfig, EngineConfig, LoadConfig, ModelConfig, SchedulerConfig
from pdserve.engine.batch import ScheduledSeq
from pdserve.engine.runner import ModelRunner
from pdserve.model import cpu_decode, cpu_linear, loader
from pdserve.model.cpu_linear import skinny_reason, skinny_rows
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

# head_dim 32 and hidden 128 take the kernel's vector loops; TINY (head_dim 8, hidden 32) and an
# intermediate size of 200 (not a multiple of 16) its element-by-element tails
MID = replace(
    TINY,
    hidden_size=128,
    intermediate_size=200,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=3,
)
QWEN = replace(MID, architecture="Qwen2ForCausalLM", tie_word_embeddings=False)  # q/k/v bias
BIASED = replace(MID, attention_bias=True)  # q/k/v and o biases
NARROW = replace(MID, intermediate_size=16)  # hidden > 2 x intermediate
MQA = replace(MID, num_key_value_heads=1)
MODELS = {
    "tiny": TINY, "mid": MID, "qwen2": QWEN, "llama-bias": BIASED, "narrow-mlp": NARROW,
    "mqa": MQA,
}  # fmt: skip
# SmolLM2-135M's layer shapes (9 query / 3 KV heads of 64, hidden 576, MLP 1536), two layers
SMOL = replace(
    TINY,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    num_hidden_layers=2,
    max_position_embeddings=256,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def _needs_kernel(dtype: torch.dtype) -> None:
    why = skinny_reason(dtype)
    if why:
        pytest.skip(f"the fused decode step needs the skinny kernel: {why}")


def _runner(
    model: ModelConfig,
    dtype: str,
    num_blocks: int = 64,
    backend: str = "auto",
    skinny_linears: bool | None = None,
    block_size: int = 4,
) -> ModelRunner:
    load = LoadConfig(
        model="dummy",
        load_format="dummy",
        dtype=dtype,
        torch_compile=False,
        attention_backend=backend,
    )
    cfg = EngineConfig(load=load, cache=CacheConfig(block_size=block_size, num_blocks=num_blocks))
    return ModelRunner(cfg, model, skinny_linears=skinny_linears)


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
    """fp32: equal to rounding. bf16: the C step rounds where eager rounds, so nearly every value
    is bit-equal; where a sum taken in another order (RMSNorm's mean) moves a value across a
    bf16 rounding boundary, that step's logits differ by a rounding step or two."""
    if dtype == "float32":
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    assert (got == want).float().mean() > 0.9
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def _compare_steps(
    model: ModelConfig,
    dtype: str,
    lens: list[int],
    block_size: int,
    steps: int,
    shrink: bool,
) -> None:
    """Prefill len(lens) random prompts in two runners, then decode ``steps`` steps with the
    fused step in one and the model's forward in the other; logits and KV pools must agree.
    ``shrink``: drop one sequence a step (batch sizes n, n - 1, ...) in reversed order."""
    per_seq = -(-(max(lens) + steps) // block_size)
    blocks = per_seq * len(lens)
    fused, plain = (_runner(model, dtype, blocks, block_size=block_size) for _ in range(2))
    assert fused.fused_decode is not None
    plain.fused_decode = None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in lens]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(lens))]
    for r in (fused, plain):  # the prompts' prefill: the model's forward in both
        r.compute_logits(
            [ScheduledSeq(str(i), p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)]
        )
    pos = list(lens)
    got, want = [], []
    for step in range(steps):
        tokens = torch.randint(3, 96, (len(lens),), generator=gen).tolist()
        order = list(range(len(lens)))
        if shrink:
            order = order[: max(1, len(lens) - step)][::-1]
        logits = [
            r.compute_logits(
                [ScheduledSeq(str(i), [tokens[i]], pos[i], tables[i], True, GREEDY)
                 for i in order]
            ).float()
            for r in (fused, plain)
        ]  # fmt: skip
        for i in order:
            pos[i] += 1
        got.append(logits[0].flatten())
        want.append(logits[1].flatten())
    _assert_close(torch.cat(got), torch.cat(want), dtype)
    _assert_close(fused.kv_pool.kv.float(), plain.kv_pool.kv.float(), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_fused_steps_equal_the_model_forward(name: str, dtype: str) -> None:
    """Batch sizes 5 down to 1, decodes in another order than their blocks, contexts that end
    inside a block and on its edge."""
    _needs_kernel(getattr(torch, dtype))
    _compare_steps(MODELS[name], dtype, [5, 9, 1, 13, 4], block_size=4, steps=7, shrink=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_steps_at_full_batch_with_smollm2_shapes(dtype: str, threads: int) -> None:
    """The kernel's largest batch (16 rows in bf16 on AMX, 32 otherwise: the skinny kernel's
    bound), blocks of 16 tokens, head_dim 64 (the attention's unrolled case), one and two
    threads."""
    tdt = getattr(torch, dtype)
    _needs_kernel(tdt)
    rows = skinny_rows(tdt)[1]
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 70, (rows,), generator=gen).tolist()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare_steps(SMOL, dtype, lens, block_size=16, steps=3, shrink=False)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("model", "dtype"), [(TINY, "float32"), (QWEN, "float32"), (MID, "bfloat16")]
)
def test_greedy_tokens_equal_with_and_without_the_fused_step(
    model: ModelConfig, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _needs_kernel(getattr(torch, dtype))
    calls = 0
    original = cpu_decode.FusedDecode.__call__

    def counted(
        self: cpu_decode.FusedDecode, *args: object
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        nonlocal calls
        calls += 1
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_decode.FusedDecode, "__call__", counted)

    def engine(fused: bool) -> OfflineEngine:
        cfg = EngineConfig(
            load=LoadConfig(model="dummy", load_format="dummy", dtype=dtype, torch_compile=False),
            cache=CacheConfig(block_size=4, num_blocks=96),
            # 16-token steps: prompts chunked beside other sequences' decodes, then decodes alone
            scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
        )
        e = OfflineEngine(cfg, model)
        if not fused:
            e.runner.fused_decode = None
        return e

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (21, 1, 9, 40, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.output_token_ids for o in engine(fused=False).generate(prompts, params)]
    assert calls == 0
    got = [o.output_token_ids for o in engine(fused=True).generate(prompts, params)]
    assert got == want
    assert calls > 5  # the decode-only steps took the fused path


def _tiny_fused(num_blocks: int) -> tuple[ModelRunner, cpu_decode.FusedDecode]:
    """An fp32 TINY runner and its fused step."""
    _needs_kernel(torch.float32)
    r = _runner(TINY, "float32", num_blocks=num_blocks)
    assert r.fused_decode is not None
    return r, r.fused_decode


def test_applies_only_to_decode_only_steps_within_the_kernels_rows() -> None:
    r, fused = _tiny_fused(num_blocks=160)
    backend = r.model.attn_backend

    def meta(query_lens: list[int]) -> object:
        n = len(query_lens)
        return backend.build_metadata(
            query_lens, [3] * n, [[i * 4, i * 4 + 1] for i in range(n)], 4
        )

    assert fused.applies(meta([1, 1, 1]), 3)
    assert not fused.applies(meta([1, 2, 1]), 4)  # a prefill chunk in the step
    assert not fused.applies(meta([2]), 2)
    hi = skinny_rows(torch.float32)[1]
    assert fused.applies(meta([1] * hi), hi)
    assert not fused.applies(meta([1] * (hi + 1)), hi + 1)  # past the skinny kernel's rows


def test_not_created_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_kernel(torch.float32)
    plain = _runner(TINY, "float32", num_blocks=16, backend="torch_ref")
    assert plain.fused_decode is None  # another attention backend
    r = _runner(TINY, "float32", num_blocks=16)
    caches = [r.kv_pool.layer(i) for i in range(TINY.num_hidden_layers)]
    fused, why = cpu_decode.FusedDecode.create(r.model, caches[:1])
    assert fused is None and "KV caches" in why
    monkeypatch.setenv("PDSERVE_CPU_FUSED_DECODE", "0")
    fused, why = cpu_decode.FusedDecode.create(r.model, caches)
    assert fused is None and "PDSERVE_CPU_FUSED_DECODE" in why
    monkeypatch.delenv("PDSERVE_CPU_FUSED_DECODE")
    no_panels = _runner(TINY, "float32", num_blocks=16, skinny_linears=False)
    assert no_panels.fused_decode is None  # a prefill worker keeps no skinny panels
    fused, why = cpu_decode.FusedDecode.create(no_panels.model, no_panels._kv_caches)
    assert fused is None and "skinny panels" in why


def test_bad_block_ids_and_positions_raise_before_the_kernel_runs() -> None:
    r, fused = _tiny_fused(num_blocks=8)
    backend = r.model.attn_backend
    ids = torch.tensor([5], dtype=torch.int64)
    before = r.kv_pool.kv.clone()
    meta = backend.build_metadata([1], [3], [[8]], 4)  # block 8 of a pool of 8
    with pytest.raises(ValueError, match="block 8"):
        fused(ids, meta)
    two = backend.build_metadata([1, 1], [3, 3], [[0], [1]], 4)
    with pytest.raises(ValueError, match="not 1 decodes"):
        fused(ids, two)  # one token id for a step of two decodes
    far = backend.build_metadata([1], [TINY.max_position_embeddings], [[0] * 40], 4)
    with pytest.raises(IndexError):
        fused(ids, far)
    assert torch.equal(r.kv_pool.kv, before)  # nothing was written


# ---- the idle-core helper (pd_decode_layers shares its matmuls and attention) -----------------


def _decode_run(
    model: ModelConfig,
    dtype: str,
    lens: list[int],
    steps: int,
    helper: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill len(lens) random prompts (seeded), then ``steps`` fused decode steps of all of
    them, with the helper on or off: (the steps' logits, the KV pool)."""
    monkeypatch.setenv("PDSERVE_CPU_DECODE_HELPER", "1" if helper else "0")
    block_size = 16
    per_seq = -(-(max(lens) + steps) // block_size)
    r = _runner(model, dtype, per_seq * len(lens), block_size=block_size)
    assert r.fused_decode is not None and r.fused_decode.helper == helper
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in lens]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(lens))]
    r.compute_logits(
        [ScheduledSeq(str(i), p, 0, tables[i], True, GREEDY) for i, p in enumerate(prompts)]
    )
    pos, out = list(lens), []
    for _ in range(steps):
        tokens = torch.randint(3, 96, (len(lens),), generator=gen).tolist()
        seqs = [ScheduledSeq(str(i), [tokens[i]], pos[i], tables[i], True, GREEDY)
                for i in range(len(lens))]  # fmt: skip
        out.append(r.compute_logits(seqs).clone())
        pos = [p + 1 for p in pos]
    return torch.stack(out), r.kv_pool.kv.clone()


def _until_helper_counted(
    run: Callable[[], tuple[torch.Tensor, torch.Tensor]], counter: int
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
    """Call ``run`` (at least once) until the helper's counter ``counter`` of
    :func:`cpu_decode.helper_stats` has grown, for at most 60 s: the helper runs only when a CPU
    is free for it (SCHED_IDLE), which on a busy machine may take a few runs. Returns the runs'
    results and whether the counter grew."""
    start = cpu_decode.helper_stats()[counter]
    runs: list[tuple[torch.Tensor, torch.Tensor]] = []
    deadline = time.monotonic() + 60
    while not runs or (cpu_decode.helper_stats()[counter] == start and time.monotonic() < deadline):
        runs.append(run())
        gc.collect()  # the run's runner goes (its context free waits for the helper)
    return runs, cpu_decode.helper_stats()[counter] > start


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Steps on one thread (the helper only joins single-threaded steps); on exit the thread
    count is restored and the helper no longer naps (set_helper_delay)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        cpu_decode.set_helper_delay(0.0)
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["smollm2-shapes", "mid"])
def test_the_helper_changes_no_bit(name: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks run the same kernels on the same data as the whole calls: logits and KV are
    bit-equal with and without the helper."""
    tdt = getattr(torch, dtype)
    _needs_kernel(tdt)
    model = SMOL if name == "smollm2-shapes" else MID
    lens = torch.randint(1, 70, (skinny_rows(tdt)[1],), generator=torch.Generator().manual_seed(2))
    with _one_thread():
        off = _decode_run(model, dtype, lens.tolist(), 4, False, monkeypatch)
        runs, computed = _until_helper_counted(
            lambda: _decode_run(model, dtype, lens.tolist(), 4, True, monkeypatch), counter=0
        )
    assert computed  # the helper computed chunks
    for on in runs:
        assert torch.equal(on[0], off[0])
        assert torch.equal(on[1], off[1])


def _gguf_dummy_weights(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make dummy weights what a model loaded from a GGUF file holds: every matrix of 32k input
    features quantised to Q4_1 (the embedding to Q8_0) and dequantised by gguf-py. Returns a list
    that counts the linears given coded panels."""
    original = loader.init_dummy_weights
    coded: list[int] = []

    def init(model: torch.nn.Module, seed: int) -> None:
        original(model, seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2 and p.shape[1] % 32 == 0:
                    p.copy_(gguf_values(p, "Q8_0" if "embed" in name else "Q4_1").to(p.dtype))

    pack = cpu_linear.skinny_pack_codes

    def counted(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        got = pack(weight)
        coded.append(got is not None)
        return got

    monkeypatch.setattr(loader, "init_dummy_weights", init)
    monkeypatch.setattr(cpu_linear, "skinny_pack_codes", counted)
    return coded


@pytest.mark.parametrize("helper", [False, True])
@pytest.mark.parametrize("name", ["smollm2-shapes", "mid"])
def test_weight_codes_change_no_bit(
    name: str, helper: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused steps over coded panels (fp32 weights that came from GGUF Q4_1 / Q8_0: see
    ``skinny_pack_codes``) give logits and KV bit-equal to the same steps over fp32 panels. MID's
    MLP (200 features) keeps fp32 panels for its down projection: formats mix within a layer."""
    _needs_kernel(torch.float32)
    if not cpu_linear._codes_built():
        pytest.skip("the skinny kernel's weight codes need AVX-512F")
    coded = _gguf_dummy_weights(monkeypatch)
    model = SMOL if name == "smollm2-shapes" else MID
    lens = torch.randint(1, 70, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    with _one_thread():
        monkeypatch.setenv("PDSERVE_CPU_WEIGHT_CODES", "0")
        off = _decode_run(model, "float32", lens, 4, helper, monkeypatch)
        assert not any(coded)
        monkeypatch.setenv("PDSERVE_CPU_WEIGHT_CODES", "1")
        on = _decode_run(model, "float32", lens, 4, helper, monkeypatch)
    assert sum(coded) >= 3 * model.num_hidden_layers + 1  # the LM head (the embedding) too
    if name == "mid":
        assert not all(coded)
    assert torch.equal(on[0], off[0])
    assert torch.equal(on[1], off[1])


def test_late_helper_chunks_are_taken_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper that naps after each claim (as if preempted) has its chunks recomputed by the
    step, and its late results are dropped: outputs stay bit-equal, and contexts freed while it
    naps inside their ops are freed only after it leaves."""
    _needs_kernel(torch.bfloat16)
    lens = [33, 7, 64, 1, 20, 45, 16, 9]
    with _one_thread():
        off = _decode_run(SMOL, "bfloat16", lens, 3, False, monkeypatch)
        cpu_decode.set_helper_delay(0.003)
        runs, taken_back = _until_helper_counted(
            lambda: _decode_run(SMOL, "bfloat16", lens, 3, True, monkeypatch), counter=1
        )
        runs.append(_decode_run(SMOL, "bfloat16", lens, 3, True, monkeypatch))
    assert taken_back  # the step took the napping helper's chunks back
    for run in runs:
        assert torch.equal(run[0], off[0])
        assert torch.equal(run[1], off[1])


def test_ops_run_whole_while_the_helper_is_off_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper that stops running (here: it naps a second inside the first chunk it claims, as
    if preempted) makes the step stop handing out ops: the rest of the run's matmuls and
    attention calls run whole on the step's thread, and the outputs stay bit-equal."""
    _needs_kernel(torch.bfloat16)
    lens = [33, 7, 64, 1, 20, 45, 16, 9]
    with _one_thread():
        off = _decode_run(SMOL, "bfloat16", lens, 6, False, monkeypatch)
        cpu_decode.set_helper_delay(1.0)
        ops0 = cpu_decode.helper_op_counts()
        on = _decode_run(SMOL, "bfloat16", lens, 6, True, monkeypatch)
        ops1 = cpu_decode.helper_op_counts()
    shared, alone = ops1[0] - ops0[0], ops1[1] - ops0[1]
    # 6 steps x (2 layers x (4 matmuls + attention) + the LM head): counted once each
    assert shared + alone == 6 * (2 * 5 + 1)
    # shared only until the helper's first claim (it may never run in the few ms the steps take)
    assert alone >= (shared + alone) // 2
    assert torch.equal(on[0], off[0])
    assert torch.equal(on[1], off[1])


def test_steps_of_two_models_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runners stepping in two threads: one holds the helper, the other runs alone (or
    waits its turn); both compute what they compute alone."""
    _needs_kernel(torch.float32)
    lens = [5, 9, 1, 13, 4]
    with _one_thread():
        want = {n: _decode_run(n_cfg, "float32", lens, 6, False, monkeypatch)
                for n, n_cfg in (("mid", MID), ("qwen2", QWEN))}  # fmt: skip
        got: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        errors: list[BaseException] = []

        def run(name: str, cfg: ModelConfig) -> None:
            try:
                got[name] = _decode_run(cfg, "float32", lens, 6, True, monkeypatch)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=a) for a in (("mid", MID), ("qwen2", QWEN))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    for name, (logits, kv) in want.items():
        assert torch.equal(got[name][0], logits)
        assert torch.equal(got[name][1], kv)


def test_helper_off_by_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CPU_DECODE_HELPER", "0")
    assert not cpu_decode.helper_applies()
    monkeypatch.setenv("PDSERVE_CPU_DECODE_HELPER", "1")
    monkeypatch.setattr(cpu_decode.os, "sched_getaffinity", lambda pid: {0})
    assert not cpu_decode.helper_applies()  # one CPU: nothing to share with


def test_a_step_after_the_context_is_freed_raises() -> None:
    """At interpreter exit the finalizer frees the context while a daemon step loop may still
    call: the call is refused, not run on freed memory."""
    r, fused = _tiny_fused(num_blocks=8)
    meta = r.model.attn_backend.build_metadata([1], [3], [[0]], 4)
    ids = torch.tensor([5], dtype=torch.int64)
    fused(ids, meta)
    fused._finalizer()  # what atexit does
    with pytest.raises(RuntimeError, match="freed"):
        fused(ids, meta)
