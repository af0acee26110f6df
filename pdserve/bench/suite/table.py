"""Markdown report of a suite run (``report.md``), rendered from its ``summary.json`` alone.

Sections: the machine and its rates; the main workload side by side (vLLM | pdserve
disaggregated | pdserve unified, ratios to vLLM); the mixed workload (short requests alone and
beside long prompts, per server; the long prompts' own latency); the issue's goals checked
against vLLM where it ran; our client against vLLM's client on the same servers; every run's
duration against its floors; the commands. Ratios are pdserve / vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.bench.suite import records as rec

SERVER_ORDER = ("vllm", "pdserve-disaggregated", "pdserve-unified")
SERVER_TITLES = {
    "vllm": "vLLM",
    "pdserve-disaggregated": "pdserve disaggregated",
    "pdserve-unified": "pdserve unified",
}
PEER = "vllm"
# Goals of issue 15: throughput >= 2x vLLM's; mixed p99 ITL within 1.5x of alone.
GOAL_THROUGHPUT_RATIO = 2.0
GOAL_ITL_RATIO = 1.5


def fmt_ms(v: float | None) -> str:
    """``v`` ms as '1.6 s' (>= 1 s), '308 ms' (>= 10 ms) or '4.2 ms'; '-' when None."""
    if v is None:
        return "-"
    if v >= 1000:
        return f"{v / 1000:.1f} s"
    return f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def fmt_pair(a: float | None, b: float | None) -> str:
    """'a / b' of two ms values sharing one unit where both allow it ('91 / 1494 ms')."""
    if a is None or b is None:
        return "-"
    if max(a, b) < 1000 and min(a, b) >= 10:
        return f"{a:.0f} / {b:.0f} ms"
    if min(a, b) >= 1000:
        return f"{a / 1000:.1f} / {b / 1000:.1f} s"
    return f"{fmt_ms(a)} / {fmt_ms(b)}"


def fmt_s(v: float) -> str:
    """Seconds: two decimals below 10 s, else whole seconds."""
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


class Runs:
    """Lookup of a summary's run records by (server, run)."""

    def __init__(self, summary: dict[str, Any]) -> None:
        self.by_key = {(r["server"], r["run"]): r for r in summary.get("runs", [])}
        present = {r["server"] for r in summary.get("runs", [])}
        self.servers = [s for s in SERVER_ORDER if s in present]
        self.servers += sorted(present - set(SERVER_ORDER))

    def get(self, server: str, run: str, key: str) -> float | None:
        rec = self.by_key.get((server, run))
        v = rec["summary"].get(key) if rec else None
        return float(v) if isinstance(v, (int, float)) else None

    def has(self, server: str, run: str) -> bool:
        return (server, run) in self.by_key

    def floors(self, server: str, run: str) -> dict[str, Any] | None:
        rec = self.by_key.get((server, run))
        return rec.get("floors") if rec else None


def machine_section(summary: dict[str, Any]) -> list[str]:
    m = summary.get("machine")
    if not m:
        return ["(machine rates were not measured)"]
    cpu = m["cpu"]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["flags"].items())
    threads = sorted(m["matmul_gflops"], key=int, reverse=True)
    mm = " / ".join(f"{m['matmul_gflops'][t]:.0f} ({t} thr)" for t in threads)
    cp = " / ".join(f"{m['copy_gbs'][t]:.1f} ({t} thr)" for t in threads)
    lines = [
        f"- CPU: {cpu['model_name']}, {cpu['logical_cpus']} logical CPUs; {flags}",
        f"- dtype {m['dtype']}; torch {m.get('torch_version', '?')}",
        f"- matmul {m['matmul_n']}x{m['matmul_n']}: {mm} GFLOP/s; copy bandwidth: {cp} GB/s",
    ]
    lin = [r for r in m.get("linears", []) if r["threads"] == m["threads"]]
    if lin:
        parts = [f"{r['name']} m={r['m']} {r['gflops']:.3g}" for r in lin]
        lines.append(f"- model matmuls ({m['threads']} thr, GFLOP/s): " + ", ".join(parts))
    lines.append(
        f"- floors use the best rates measured: {m['peak_gflops']:.0f} GFLOP/s and "
        f"{m['peak_copy_gbs']:.1f} GB/s"
    )
    return lines


def _with_ratio(text: str, r: float | None) -> str:
    return f"{text} = {r:.2f}x" if r is not None else text


def main_section(summary: dict[str, Any], runs: Runs) -> list[str]:
    servers = [s for s in runs.servers if runs.has(s, rec.RUN_MAIN)]
    if not servers:
        return []
    w = summary["config"]["main_workload"]
    head = (f"main: {w['input_len']} in / {w['output_len']} out, {w['num_prompts']} prompts, "
            f"concurrency {w['max_concurrency']}")  # fmt: skip
    peer = PEER if PEER in servers else None

    def cell(server: str, key: str, pair: str | None = None, tput: bool = False) -> str:
        v = runs.get(server, rec.RUN_MAIN, key)
        if tput:
            d = runs.get(server, rec.RUN_MAIN, "duration")
            text = f"{v:.1f} ({d:.0f} s)" if v is not None and d is not None else "-"
        elif pair:
            text = fmt_pair(v, runs.get(server, rec.RUN_MAIN, pair))
        else:
            text = fmt_ms(v)
        if peer and server != peer and (tput or key == "p99_tpot_ms"):
            return _with_ratio(text, ratio(v, runs.get(peer, rec.RUN_MAIN, key)))
        return text

    def floor_cell(server: str) -> str:
        f = runs.floors(server, rec.RUN_MAIN)
        if not f:
            return "-"
        over = f.get("duration_over_floor")
        over_text = f"{over:.1f}x" if over else "-"
        return f"{fmt_s(f['arithmetic_s'])} / {fmt_s(f['memory_s'])} s ({f['bound']}); {over_text}"

    rows = [
        [f"{head}: output tok/s (duration)"]
        + [cell(s, "output_throughput", tput=True) for s in servers],  # fmt: skip
        ["mean / p99 TTFT"] + [cell(s, "mean_ttft_ms", "p99_ttft_ms") for s in servers],
        ["mean / p99 TPOT"] + [cell(s, "mean_tpot_ms", "p99_tpot_ms") for s in servers],
        ["p99 TPOT"] + [cell(s, "p99_tpot_ms") for s in servers],
        ["p50 / p99 ITL"] + [cell(s, "median_itl_ms", "p99_itl_ms") for s in servers],
        ["floors: arithmetic / memory (bound); duration / floor"]
        + [floor_cell(s) for s in servers],
    ]
    return _table(["workload", *[SERVER_TITLES.get(s, s) for s in servers]], rows)


def mixed_section(summary: dict[str, Any], runs: Runs) -> list[str]:
    servers = [s for s in runs.servers if runs.has(s, rec.RUN_SHORT_MIXED)]
    if not servers:
        return []
    header = ["short requests"]
    for s in servers:
        header += [f"{SERVER_TITLES.get(s, s)} alone", f"{SERVER_TITLES.get(s, s)} mixed"]
    g = runs.get

    def both(fn: Any) -> list[str]:
        return [
            c for s in servers for c in (fn(s, rec.RUN_SHORT_ALONE), fn(s, rec.RUN_SHORT_MIXED))
        ]

    def itl(s: str, run: str) -> str:
        text = fmt_pair(g(s, run, "median_itl_ms"), g(s, run, "p99_itl_ms"))
        if run == rec.RUN_SHORT_MIXED:
            r = ratio(g(s, run, "p99_itl_ms"), g(s, rec.RUN_SHORT_ALONE, "p99_itl_ms"))
            return f"{text} ({r:.1f}x)" if r is not None else text
        return text

    def long_cell(s: str, run: str, fn: Any) -> str:
        return fn(s) if run == rec.RUN_SHORT_MIXED else "-"

    def long_count(s: str) -> str:
        long = runs.by_key.get((s, rec.RUN_LONG_MIXED))
        if not long:
            return "-"
        done, failed = long["summary"].get("completed", 0), long["summary"].get("failed", 0)
        cut = long.get("unfinished", 0)
        text = f"{done + failed} sent, {done} completed"
        if failed - cut:
            text += f", {failed - cut} failed"
        return text + (f", {cut} cut off unfinished" if cut else "")

    rows = [
        ["mean TPOT"] + both(lambda s, r: fmt_ms(g(s, r, "mean_tpot_ms"))),
        ["p50 / p99 ITL"] + both(itl),
        ["mean / p99 TTFT"] + both(lambda s, r: fmt_pair(g(s, r, "mean_ttft_ms"),
                                                          g(s, r, "p99_ttft_ms"))),  # fmt: skip
        ["short run duration"] + both(lambda s, r: f"{g(s, r, 'duration') or 0:.0f} s"),
        ["long prompts"] + both(lambda s, r: long_cell(s, r, long_count)),
        ["long: mean / p99 TTFT"] + both(lambda s, r: long_cell(s, r, lambda x: fmt_pair(
            g(x, rec.RUN_LONG_MIXED, "mean_ttft_ms"), g(x, rec.RUN_LONG_MIXED, "p99_ttft_ms")))),
        ["long: mean / p99 E2EL"] + both(lambda s, r: long_cell(s, r, lambda x: fmt_pair(
            g(x, rec.RUN_LONG_MIXED, "mean_e2el_ms"), g(x, rec.RUN_LONG_MIXED, "p99_e2el_ms")))),
    ]  # fmt: skip
    w = summary["config"]["mixed_workload"]
    intro = (
        f"Short requests: {w['short_input_len']} in / {w['short_output_len']} out, "
        f"{w['short_num_prompts']} prompts, concurrency {w['short_max_concurrency']}, "
        f"{w['endpoint']}; mixed: beside {w['long_input_len']}-token prompts "
        f"({w['long_output_len']} out) at {w['long_rate']:g}/s from a second client"
        + (f" (at most {w['long_num_prompts']})" if w.get("long_num_prompts") else "")
        + ", whose "
        f"requests still unfinished {w.get('long_drain_s', 0):g} s after the short run are cut "
        f"off; a mixed short run taking over {w.get('mixed_cap_factor', 0):g}x its time alone "
        "(and over 120 s) is cut off and reported as failed. (Nx) = p99 ITL mixed / alone."
    )
    return [intro, "", *_table(header, rows)]


def _check(server: str, what: str, shown: str, goal: str, ok: bool) -> str:
    return f"- {server}: {what} {shown} (goal {goal}): {'met' if ok else 'not met'}"


def goals_section(runs: Runs) -> list[str]:
    """Issue 15's goals, where vLLM ran in the same suite."""
    if PEER not in runs.servers:
        return []
    g = runs.get
    lines = []
    for s in runs.servers:
        if s == PEER:
            continue
        r = ratio(
            g(s, rec.RUN_MAIN, "output_throughput"), g(PEER, rec.RUN_MAIN, "output_throughput")
        )
        if r is not None:
            lines.append(_check(s, "main output throughput", f"{r:.2f}x vLLM's",
                                f">= {GOAL_THROUGHPUT_RATIO:g}x", r >= GOAL_THROUGHPUT_RATIO))  # fmt: skip
        r = ratio(g(s, rec.RUN_SHORT_MIXED, "p99_itl_ms"), g(s, rec.RUN_SHORT_ALONE, "p99_itl_ms"))
        if r is not None:
            lines.append(_check(s, "short p99 ITL mixed / alone", f"{r:.2f}x",
                                f"<= {GOAL_ITL_RATIO:g}x", r <= GOAL_ITL_RATIO))  # fmt: skip
        for what, run, key in (("main p99 TPOT", rec.RUN_MAIN, "p99_tpot_ms"),
                               ("short mean TTFT mixed", rec.RUN_SHORT_MIXED, "mean_ttft_ms")):  # fmt: skip
            a, b = g(s, run, key), g(PEER, run, key)
            if a is not None and b is not None:
                lines.append(_check(s, what, f"{fmt_ms(a)} vs vLLM {fmt_ms(b)}", "below", a < b))
    return lines


def clients_section(runs: Runs) -> list[str]:
    """Our client and vLLM's on the main workload against the same servers."""
    servers = [s for s in runs.servers if runs.has(s, rec.RUN_MAIN_PEER_CLIENT)]
    if not servers:
        return []
    rows = []
    for s in servers:
        for run, client in (
            (rec.RUN_MAIN, "pdserve bench"),
            (rec.RUN_MAIN_PEER_CLIENT, "vllm bench"),
        ):
            g = runs.get
            rows.append([
                SERVER_TITLES.get(s, s), client,
                f"{g(s, run, 'output_throughput') or 0:.1f}",
                fmt_pair(g(s, run, "mean_ttft_ms"), g(s, run, "p99_ttft_ms")),
                fmt_pair(g(s, run, "mean_tpot_ms"), g(s, run, "p99_tpot_ms")),
                fmt_pair(g(s, run, "median_itl_ms"), g(s, run, "p99_itl_ms")),
            ])  # fmt: skip
    header = ["server", "client", "output tok/s", "mean / p99 TTFT", "mean / p99 TPOT",
              "p50 / p99 ITL"]  # fmt: skip
    return _table(header, rows)


def floors_section(summary: dict[str, Any]) -> list[str]:
    rows = []
    for r in summary.get("runs", []):
        f = r.get("floors")
        if not f:
            continue
        over = f.get("duration_over_floor")
        rows.append([
            SERVER_TITLES.get(r["server"], r["server"]),
            r["run"] + ("" if r["client"] == "pdserve" else f" ({r['client']} client)"),
            fmt_s(f["duration_s"]), f"{f['flops'] / 1e12:.3g}", fmt_s(f["arithmetic_s"]),
            f"{f['bytes_read'] / 1e9:.3g}", f"{f['decode_steps']}", fmt_s(f["memory_s"]),
            f"{over:.1f}x" if over else "-",
        ])  # fmt: skip
    if not rows:
        return []
    header = ["server", "run", "duration s", "TFLOP", "arithmetic floor s", "GB read",
              "decode steps", "memory floor s", "duration / floor"]  # fmt: skip
    return _table(header, rows)


def render_report(summary: dict[str, Any]) -> str:
    """The whole report.md text."""
    runs = Runs(summary)
    cfg = summary["config"]
    git = summary.get("git") or {}
    out = [
        f"# Serving suite: {cfg['model']}, {cfg['dtype']}" + (" (--quick)" if cfg["quick"] else ""),
        "",
        f"pdserve commit {git.get('commit', '?')}"
        + (" (dirty)" if git.get("dirty") else "")
        + f"; suite took {summary.get('elapsed_s', 0):.0f} s.",
        "",
        "## Machine",
        "",
        *machine_section(summary),
    ]
    sections = (
        ("Main workload", main_section(summary, runs)),
        ("Mixed workload", mixed_section(summary, runs)),
        ("Goals (issue 15)", goals_section(runs)),
        ("Clients compared (main workload)", clients_section(runs)),
        (f"Floors ({rec.RUN_MIXED_BOTH}: short + long work of the mixed run, whole span)",
         floors_section(summary)),
    )  # fmt: skip
    for title, body in sections:
        if body:
            out += ["", f"## {title}", "", *body]
    plots = summary.get("plots") or {}
    if plots:
        out += ["", "## Plots", ""]
        out += [f"- {name}: " + ", ".join(f"[{p.split('/')[-1]}]({p})" for p in paths)
                for name, paths in plots.items()]  # fmt: skip
    if summary.get("servers"):
        out += ["", "## Commands", ""]
        for name, info in summary["servers"].items():
            out.append(f"- {name}: `{' '.join(info['command'])}`")
            out += [f"  - `{c}`" for c in info.get("client_commands", [])]
    if summary.get("errors"):
        out += ["", "## Errors", "", *[f"- {e}" for e in summary["errors"]]]
    return "\n".join(out) + "\n"
