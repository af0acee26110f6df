"""The serving suite's orchestration (``make bench``; flags in bench/serving_suite.py).

Lifecycle of :func:`run_suite`:

1. measure the machine (:func:`pdserve.bench.machine.measure_machine`) in the served dtype and
   build every workload's prompts (once; every server gets the same prompts);
2. for each server in turn (the vLLM peer first when given, then pdserve in each ``--modes``
   mode; one at a time, as they would fight over the cores): start it on free loopback ports,
   wait until it is ready, run the main workload with our client (and with vLLM's client when
   the peer is given), run the mixed workload (short alone, then short beside long prompts),
   stop it by pid. A server that fails is recorded and the suite goes on with the next;
3. compute every run's floors, draw the charts with ``pdserve bench plot``'s code, and write
   ``summary.json`` and ``report.md`` (:mod:`pdserve.bench.suite.table`).

Results directory layout: ``config.json``, ``machine.json``, ``runs/*.json`` (one result file
per run and client), ``logs/*.log`` (each server's and each vLLM client's output),
``plots/main/``, ``plots/mixed/``, ``summary.json``, ``report.md``.
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pdserve.bench.datasets import SampleRequest, random_requests
from pdserve.bench.floors import ModelCost, model_cost
from pdserve.bench.machine import MachineRates, measure_machine
from pdserve.bench.plot import plot_results
from pdserve.bench.report import result_to_dict, save_result
from pdserve.bench.serve import BenchConfig, BenchmarkResult, run_benchmark
from pdserve.bench.suite import workloads as wl
from pdserve.bench.suite.mixed import UNFINISHED, LongPrompts, run_mixed
from pdserve.bench.suite.records import (
    RUN_LONG_MIXED,
    RUN_MAIN,
    RUN_MAIN_PEER_CLIENT,
    RUN_MIXED_BOTH,
    RUN_SHORT_ALONE,
    RUN_SHORT_MIXED,
    RunRecord,
    completed_lengths,
    floors_for,
    headline,
    time_span_s,
)
from pdserve.bench.suite.servers import REPO_ROOT, ServerProcess, ServerSpec, pdserve_spec
from pdserve.bench.suite.table import render_report
from pdserve.bench.suite.vllm_peer import VllmPeer
from pdserve.bench.word_tokenizer import BenchTokenizer, load_bench_tokenizer

MODES = ("disaggregated", "unified")
PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class SuiteConfig:
    """What one suite run does. ``dtype`` is concrete ('float32' | 'bfloat16'); ``serve_args``
    are added to every ``pdserve serve``; ``mixed_modes``: pdserve modes that also run the mixed
    workload; ``peer``: the vLLM peer, or None. Timeouts in seconds."""

    out_dir: Path
    dtype: str
    model: str = "smollm2"
    load_format: str = "auto"
    tokenizer: str | None = None  # builds prompts; default: the model
    modes: tuple[str, ...] = MODES
    workloads: tuple[str, ...] = wl.WORKLOADS
    mixed_modes: tuple[str, ...] = ("disaggregated",)
    quick: bool = False
    peer: VllmPeer | None = None
    serve_args: tuple[str, ...] = ()
    seed: int = 0
    max_model_len: int = 2048
    long_num_prompts: int = 0  # > 0: the mixed run's long prompts stop after this many
    ready_timeout_s: float = 600.0
    request_timeout_s: float = 1800.0
    measure_reps: int = 5

    def __post_init__(self) -> None:
        for m in (*self.modes, *self.mixed_modes):
            if m not in MODES:
                raise ValueError(f"mode {m!r} is not one of {', '.join(MODES)}")
        for w in self.workloads:
            if w not in wl.WORKLOADS:
                raise ValueError(f"workload {w!r} is not one of {', '.join(wl.WORKLOADS)}")
        if not self.modes and self.peer is None:
            raise ValueError("nothing to run: no --modes and no --with-vllm")


@dataclass
class _Inputs:
    """Prompts of every run (built once, shared by every server)."""

    tokenizer: BenchTokenizer
    main: list[SampleRequest] = field(default_factory=list)
    short_alone: list[SampleRequest] = field(default_factory=list)
    short_mixed: list[SampleRequest] = field(default_factory=list)
    longs: list[SampleRequest] = field(default_factory=list)


class Suite:
    """One suite run (see the module docstring). ``echo`` prints progress lines."""

    def __init__(self, config: SuiteConfig, echo: Callable[[str], None] = print) -> None:
        self.cfg = config
        self.echo_fn = echo
        self.main_wl, self.mixed_wl = wl.workloads_for(config.quick)
        if config.long_num_prompts:
            self.mixed_wl = replace(self.mixed_wl, long_num_prompts=config.long_num_prompts)
        self.records: list[RunRecord] = []
        self.errors: list[str] = []
        self.servers: dict[str, dict[str, Any]] = {}
        self.t0 = time.monotonic()
        self.out = config.out_dir
        self.machine: MachineRates | None = None
        self.cost: ModelCost | None = None
        self.inputs: _Inputs | None = None

    def echo(self, line: str) -> None:
        self.echo_fn(f"[{time.monotonic() - self.t0:6.0f} s] {line}")

    # -- preparation ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """Machine rates, model cost and every run's prompts."""
        from pdserve.config import LoadConfig
        from pdserve.model.loader import load_model_config

        cfg = self.cfg
        mc = load_model_config(LoadConfig(model=cfg.model, load_format=cfg.load_format))
        self.cost = model_cost(mc, cfg.dtype)
        self.echo(f"measuring the machine ({cfg.dtype})")
        self.machine = measure_machine(cfg.dtype, mc, reps=cfg.measure_reps)
        m = self.machine
        self.echo(
            f"matmul {m.matmul_gflops[m.threads]:.0f} GFLOP/s ({m.threads} threads), peak "
            f"{m.peak_gflops:.0f}; copy {m.peak_copy_gbs:.1f} GB/s"
        )
        _write_json(self.out / "machine.json", m.to_dict())
        tok = load_bench_tokenizer(cfg.tokenizer or cfg.model)
        inputs = _Inputs(tok)
        s, main, mixed = cfg.seed, self.main_wl, self.mixed_wl
        if "main" in cfg.workloads:
            inputs.main = random_requests(tok, main.num_prompts, main.input_len, main.output_len,
                                          seed=s + wl.SEED_MAIN)  # fmt: skip
        if "mixed" in cfg.workloads:
            for attr, seed in (("short_alone", wl.SEED_SHORT_ALONE),
                               ("short_mixed", wl.SEED_SHORT_MIXED)):  # fmt: skip
                reqs = random_requests(tok, mixed.short_num_prompts, mixed.short_input_len,
                                       mixed.short_output_len, seed=s + seed)  # fmt: skip
                setattr(inputs, attr, [_relabel(r, "short") for r in reqs])
        self.inputs = inputs

    def _long(self, i: int) -> SampleRequest:
        """Long prompt ``i`` of the mixed run (its own seed: distinct, reproducible)."""
        assert self.inputs is not None
        w = self.mixed_wl
        req = random_requests(self.inputs.tokenizer, 1, w.long_input_len, w.long_output_len,
                              seed=self.cfg.seed + wl.SEED_LONG + i)[0]  # fmt: skip
        return _relabel(req, "long")

    # -- one server ----------------------------------------------------------------------------
    def server_specs(self) -> list[ServerSpec]:
        """The servers of this run, in order."""
        cfg = self.cfg
        specs = [cfg.peer.serve_spec(cfg.dtype)] if cfg.peer is not None else []
        extra = (*(("--load-format", cfg.load_format) if cfg.load_format != "auto" else ()),
                 *cfg.serve_args)  # fmt: skip
        specs += [pdserve_spec(m, cfg.model, cfg.dtype, cfg.max_model_len, extra)
                  for m in cfg.modes]  # fmt: skip
        return specs

    def run_server(self, spec: ServerSpec) -> None:
        """Start ``spec``, run its workloads, stop it. Failures are recorded, not raised."""
        info: dict[str, Any] = {"command": list(spec.argv), "base_url": spec.base_url}
        self.servers[spec.name] = info
        self.echo(f"{spec.name}: starting ({' '.join(spec.argv[-14:])})")
        server = ServerProcess(spec, self.out / "logs" / f"{spec.name}.log")
        try:
            server.start()
            info["ready_s"] = server.wait_ready(self.cfg.ready_timeout_s)
            self.echo(f"{spec.name}: ready after {info['ready_s']:.0f} s")
            model = _served_model(spec.base_url)
            info["model"] = model
            if "main" in self.cfg.workloads:
                self._main(spec, model)
            mixed_here = spec.name == "vllm" or spec.name.removeprefix("pdserve-") in (
                self.cfg.mixed_modes
            )
            if "mixed" in self.cfg.workloads and mixed_here:
                self._mixed(spec, model)
        except Exception as e:  # one server's failure must not lose the others' results
            msg = f"{spec.name}: {type(e).__name__}: {e}".splitlines()[0]
            self.errors.append(msg)
            info["error"] = msg
            self.echo(f"FAILED {msg}")
        finally:
            info["exit_code"] = server.stop()

    def _our_client(self, spec: ServerSpec, flags: list[str]) -> str:
        """The ``pdserve bench serve`` command equivalent to a run the suite makes in-process."""
        tok = self.cfg.tokenizer or self.cfg.model
        return shlex.join(["pdserve", "bench", "serve", "--base-url", spec.base_url,
                           "--tokenizer", tok, *flags])  # fmt: skip

    def _client_command(self, spec: ServerSpec, command: str) -> None:
        self.servers[spec.name].setdefault("client_commands", []).append(command)

    def _config(self, spec: ServerSpec, model: str, label: str, **kw: Any) -> BenchConfig:
        return BenchConfig(
            base_url=spec.base_url, model=model, ignore_eos=True, percentiles=PERCENTILES,
            request_timeout_s=self.cfg.request_timeout_s, disable_tqdm=True, label=label, **kw,
        )  # fmt: skip

    def _save(self, result: BenchmarkResult, spec: ServerSpec, run: str) -> dict[str, Any]:
        doc = result_to_dict(result, {"suite_run": run, "server": spec.name}, save_texts=False)
        save_result(doc, self.out / "runs" / f"{spec.name}-{run}.json")
        return doc

    def _record(self, spec: ServerSpec, run: str, client: str, doc: dict[str, Any],
                max_batch: int | None) -> RunRecord:  # fmt: skip
        assert self.cost is not None and self.machine is not None
        floors = None
        if max_batch is not None:
            floors = floors_for(self.cost, self.machine, completed_lengths(doc), max_batch,
                                float(doc["duration"]))  # fmt: skip
        rec = RunRecord(spec.name, run, client, f"runs/{spec.name}-{run}.json", headline(doc),
                        floors)  # fmt: skip
        self.records.append(rec)
        s = rec.summary
        self.echo(
            f"{spec.name} {run} ({client} client): {s.get('completed')} ok / {s.get('failed')} "
            f"failed, {s.get('output_throughput', 0):.1f} tok/s in {s.get('duration', 0):.0f} s, "
            f"mean TTFT {s.get('mean_ttft_ms', 0):.0f} ms, p99 TPOT {s.get('p99_tpot_ms', 0):.0f} "
            f"ms, p99 ITL {s.get('p99_itl_ms', 0):.0f} ms"
        )
        return rec

    def _main(self, spec: ServerSpec, model: str) -> None:
        assert self.inputs is not None
        w = self.main_wl
        config = self._config(spec, model, spec.name, endpoint=w.endpoint,
                              max_concurrency=w.max_concurrency, seed=self.cfg.seed)  # fmt: skip
        self.echo(f"{spec.name}: main workload ({w.num_prompts} prompts)")
        self._client_command(spec, self._our_client(spec, wl.main_flags(w, self.cfg.seed)))
        result = asyncio.run(run_benchmark(config, self.inputs.main, self.inputs.tokenizer))
        self._record(spec, RUN_MAIN, "pdserve", self._save(result, spec, RUN_MAIN),
                     w.max_concurrency)  # fmt: skip
        if self.cfg.peer is not None:
            self.echo(f"{spec.name}: main workload, vLLM's client")
            path = self.out / "runs" / f"{spec.name}-{RUN_MAIN_PEER_CLIENT}.json"
            peer = self.cfg.peer
            argv = peer.bench_argv(spec.base_url, model, w, self.cfg.seed + wl.SEED_MAIN_PEER_CLIENT,
                                   f"{spec.name} (vllm client)", path)  # fmt: skip
            self._client_command(spec, shlex.join(argv))
            log = self.out / "logs" / f"{spec.name}-{RUN_MAIN_PEER_CLIENT}.log"
            doc = peer.run_bench(argv, path, log, self.cfg.request_timeout_s)
            self._record(spec, RUN_MAIN_PEER_CLIENT, "vllm", doc, w.max_concurrency)

    def _mixed(self, spec: ServerSpec, model: str) -> None:
        assert self.inputs is not None
        w = self.mixed_wl
        short = self._config(spec, model, f"{spec.name} short alone", endpoint=w.endpoint,
                             max_concurrency=w.short_max_concurrency)  # fmt: skip
        self.echo(f"{spec.name}: short requests alone ({w.short_num_prompts})")
        seed = self.cfg.seed
        self._client_command(
            spec, self._our_client(spec, wl.short_flags(w, seed + wl.SEED_SHORT_ALONE))
        )
        alone = asyncio.run(run_benchmark(short, self.inputs.short_alone, self.inputs.tokenizer))
        alone_doc = self._save(alone, spec, RUN_SHORT_ALONE)
        self._record(spec, RUN_SHORT_ALONE, "pdserve", alone_doc, w.short_max_concurrency)
        # enough long prompts prepared for a mixed run 4x as long as the run alone
        n_long = math.ceil(w.long_rate * max(alone.metrics.duration_s * 4, 30.0)) + 2
        if w.long_num_prompts:
            n_long = w.long_num_prompts
        if len(self.inputs.longs) < n_long:
            self.inputs.longs += [self._long(i) for i in range(len(self.inputs.longs), n_long)]
        longs = LongPrompts(self.inputs.longs, self._long)
        long_cfg = self._config(spec, model, f"{spec.name} long mixed", endpoint=w.endpoint,
                                request_rate=w.long_rate)  # fmt: skip
        mixed_cfg = self._config(spec, model, f"{spec.name} short mixed", endpoint=w.endpoint,
                                 max_concurrency=w.short_max_concurrency)  # fmt: skip
        self.echo(f"{spec.name}: short requests beside long prompts at {w.long_rate:g}/s")
        self._client_command(
            spec, self._our_client(spec, wl.short_flags(w, seed + wl.SEED_SHORT_MIXED, 0))
            + f"   # at once: long prompts, random {w.long_input_len} in / {w.long_output_len} "
            f"out, evenly at {w.long_rate:g}/s from a second client until this run ends"
            + (f" (at most {w.long_num_prompts})" if w.long_num_prompts else ""),
        )  # fmt: skip
        short_res, long_res = asyncio.run(
            run_mixed(mixed_cfg, self.inputs.short_mixed, long_cfg, longs,
                      self.inputs.tokenizer, w.long_drain_s,
                      w.mixed_cap_s(alone.metrics.duration_s), w.long_num_prompts)
        )  # fmt: skip
        short_doc = self._save(short_res, spec, RUN_SHORT_MIXED)
        long_doc = self._save(long_res, spec, RUN_LONG_MIXED)
        self._record(spec, RUN_SHORT_MIXED, "pdserve", short_doc, w.short_max_concurrency)
        rec = self._record(spec, RUN_LONG_MIXED, "pdserve", long_doc, None)
        rec.extra["long_prompts_built_late"] = longs.made_late
        rec.extra["unfinished"] = sum(1 for e in long_doc["errors"] if e.startswith(UNFINISHED))
        # the floor of everything the server did in the mixed run, against its whole span
        assert self.cost is not None and self.machine is not None
        lengths = completed_lengths(short_doc) + completed_lengths(long_doc)
        both = floors_for(self.cost, self.machine, lengths,
                          w.short_max_concurrency + len(long_res.requests),
                          time_span_s([short_doc, long_doc]))  # fmt: skip
        self.records.append(RunRecord(spec.name, RUN_MIXED_BOTH, "pdserve", "", {}, both))

    # -- the whole run -------------------------------------------------------------------------
    def run(self) -> Path:
        """Everything; returns the path of report.md."""
        self.out.mkdir(parents=True, exist_ok=True)
        _write_json(self.out / "config.json", _config_doc(self.cfg, self.main_wl, self.mixed_wl))
        self.prepare()
        for spec in self.server_specs():
            self.run_server(spec)
        plots = self.plot()
        summary = {
            "config": _config_doc(self.cfg, self.main_wl, self.mixed_wl),
            "machine": self.machine.to_dict() if self.machine else None,
            "git": _git_describe(),
            "servers": self.servers,
            "runs": [r.to_dict() for r in self.records],
            "plots": plots,
            "errors": self.errors,
            "elapsed_s": time.monotonic() - self.t0,
        }
        _write_json(self.out / "summary.json", summary)
        report = self.out / "report.md"
        report.write_text(render_report(summary))
        self.echo(f"done in {summary['elapsed_s']:.0f} s: {report}")
        return report

    def plot(self) -> dict[str, list[str]]:
        """Charts of the main runs and of the mixed runs (``pdserve bench plot``'s code)."""
        out: dict[str, list[str]] = {}
        groups = {
            "main": (RUN_MAIN, RUN_MAIN_PEER_CLIENT),
            "mixed": (RUN_SHORT_ALONE, RUN_SHORT_MIXED, RUN_LONG_MIXED),
        }
        for name, runs in groups.items():
            files = [self.out / r.file for r in self.records if r.run in runs and r.file]
            if files:
                paths = plot_results(files, self.out / "plots" / name)
                out[name] = [str(p.relative_to(self.out)) for p in paths]
        return out


def run_suite(config: SuiteConfig, echo: Callable[[str], None] = print) -> tuple[Path, list[str]]:
    """Run the suite; returns (report.md path, error lines of servers that failed)."""
    suite = Suite(config, echo)
    report = suite.run()
    return report, suite.errors


def _relabel(req: SampleRequest, label: str) -> SampleRequest:
    return SampleRequest(req.prompt, req.prompt_len, req.output_len, req.messages, req.timestamp,
                         label)  # fmt: skip


def _served_model(base_url: str) -> str:
    """First model id of ``GET /v1/models``."""
    with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as resp:
        return str(json.load(resp)["data"][0]["id"])


def _write_json(path: Path, doc: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def _config_doc(cfg: SuiteConfig, main: wl.MainWorkload, mixed: wl.MixedWorkload) -> dict:
    doc = {k: v for k, v in asdict(cfg).items() if k != "peer"}
    doc["peer"] = str(cfg.peer.script) if cfg.peer else None
    doc["out_dir"] = str(cfg.out_dir)
    doc["main_workload"] = asdict(main)
    doc["mixed_workload"] = asdict(mixed)
    return doc


def _git_describe() -> dict[str, Any]:
    """Commit and dirty flag of the checkout the servers ran from (empty outside git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=10).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": head, "dirty": bool(dirty)} if head else {}
