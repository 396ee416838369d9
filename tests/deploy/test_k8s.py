"""deploy/k8s: every overlay rendered by kustomize (``kubectl kustomize``), validated against the
Kubernetes 1.30 API schemas (kubernetes-validate, offline, strict), scanned by a policy checker
(checkov) with every failed check explained, and checked against what the service does: its
probes, drain, threads, metrics, labels and the Grafana dashboard."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from app.observability.metrics import Metrics
from app.settings import Settings
from tests.deploy import dashboard
from tests.helpers import ROOT, require

pytestmark = pytest.mark.external

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "cpu-utilization")
KUBERNETES_VERSION = "1.30"
CRDS = {"ServiceMonitor"}  # Prometheus Operator's: not in the Kubernetes schemas, checked below
# Checks the scan fails on purpose; docs/deploy.md "Kubernetes" gives the same reasons to users.
EXPLAINED = {
    "CKV_K8S_35": "API keys reach the service as an environment variable (TRANSLATOR_API_KEYS, "
    "like every setting); the Secret is optional and only the translator container reads it",
    "CKV_K8S_43": "the image is one the user builds and pushes; its digest is theirs to pin "
    "(kustomize edit set image transformer-translator=REGISTRY/IMAGE@sha256:...)",
}


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    require(kubectl is not None, "kubectl (with its built-in kustomize) not installed")
    assert kubectl is not None
    done = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, (kind, [d["kind"] for d in docs])
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["translator"]
    return dict(pod["containers"][0])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_for_the_kubernetes_api(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    for doc in rendered[overlay]:
        if doc["kind"] in CRDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises on any error
    kinds = sorted(d["kind"] for d in rendered[overlay])
    base = ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Namespace", "NetworkPolicy", "PodDisruptionBudget",
            "Service"]  # fmt: skip
    assert kinds == sorted(base + ([] if overlay == "cpu-utilization" else ["ServiceMonitor"]))
    assert {d["metadata"].get("namespace") for d in rendered[overlay] if d["kind"] != "Namespace"} == {"translator"}


def test_the_policy_checker_finds_nothing_unexplained(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    checkov = shutil.which("checkov")
    require(checkov is not None, "checkov not installed (.ci/run installs it in a venv of its own)")
    assert checkov is not None
    for overlay, docs in rendered.items():
        (tmp_path / f"{overlay}.yaml").write_text(yaml.safe_dump_all(docs))
    done = subprocess.run(
        [checkov, "-d", str(tmp_path), "--framework", "kubernetes", "-o", "json", "--quiet", "--compact"],
        capture_output=True,
        text=True,
    )
    reports = json.loads(done.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = {c["check_id"] for r in reports for c in r["results"]["failed_checks"]}
    passed = sum(r["summary"]["passed"] for r in reports)
    assert passed > 100 and failed <= set(EXPLAINED), sorted(failed - set(EXPLAINED))
    readme = (ROOT / "docs" / "deploy.md").read_text()
    assert all(check in readme for check in EXPLAINED)


def test_probes_drain_and_threads_match_the_service(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cpu"]
    c = container(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert port == Settings().port
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/ready" and startup["periodSeconds"] * startup["failureThreshold"] >= 180
    settings = one(docs, "ConfigMap")["data"]
    pause = float(re.search(r"sleep\((\d+(?:\.\d+)?)\)", " ".join(c["lifecycle"]["preStop"]["exec"]["command"]))[1])
    drain = float(settings["TRANSLATOR_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] > pause + drain
    threads = next(e for e in c["env"] if e["name"] == "TRANSLATOR_THREADS")["valueFrom"]["resourceFieldRef"]
    assert threads["resource"] == "requests.cpu" and threads["divisor"] == "1"
    assert c["resources"]["requests"]["cpu"] == c["resources"]["limits"]["cpu"]  # threads = cores it may use


def test_every_configured_setting_is_one_the_service_takes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for overlay in OVERLAYS:
        data = one(rendered[overlay], "ConfigMap")["data"]
        fields = {k.removeprefix("TRANSLATOR_").lower(): v for k, v in data.items()}
        assert set(fields) <= set(Settings.model_fields), data
        Settings(**fields)  # valid values


def test_pods_run_unprivileged_with_a_read_only_root(rendered: dict[str, list[dict[str, Any]]]) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for overlay in OVERLAYS:
        pod = one(rendered[overlay], "Deployment")["spec"]["template"]["spec"]
        c = container(rendered[overlay])
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert f"USER {pod['securityContext']['runAsUser']}:" in dockerfile
        assert pod["automountServiceAccountToken"] is False
        sc = c["securityContext"]
        assert (
            sc["readOnlyRootFilesystem"]
            and not sc["allowPrivilegeEscalation"]
            and sc["capabilities"]["drop"] == ["ALL"]
        )
        assert {m["mountPath"] for m in c["volumeMounts"]} == {"/tmp"}  # the only writable place
    namespace = one(rendered["cpu"], "Namespace")["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "restricted"


def test_autoscaling_reads_a_metric_the_service_exports(rendered: dict[str, list[dict[str, Any]]]) -> None:
    exported = {family.name for family in Metrics().registry.collect()}
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    served = {rule["name"]["as"]: rule for rule in adapter["rules"]["custom"]}
    for overlay in ("cpu", "gpu"):
        hpa = one(rendered[overlay], "HorizontalPodAutoscaler")["spec"]
        [metric] = hpa["metrics"]
        name = metric["pods"]["metric"]["name"]
        assert name in exported and name in served
        assert served[name]["seriesQuery"].startswith(name + "{")
        assert hpa["scaleTargetRef"]["name"] == one(rendered[overlay], "Deployment")["metadata"]["name"]
    fallback = one(rendered["cpu-utilization"], "HorizontalPodAutoscaler")["spec"]["metrics"]
    target = {"type": "Utilization", "averageUtilization": 70}
    assert fallback == [{"type": "Resource", "resource": {"name": "cpu", "target": target}}]


def test_the_gpu_overlay_asks_for_one_gpu_and_runs_fewer_larger_replicas(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    gpu, cpu = rendered["gpu"], rendered["cpu"]
    c = container(gpu)
    pod = one(gpu, "Deployment")["spec"]["template"]["spec"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"].endswith(":cuda")
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert one(gpu, "ConfigMap")["data"]["TRANSLATOR_DEVICE"] == "cuda"
    g, k = one(gpu, "HorizontalPodAutoscaler")["spec"], one(cpu, "HorizontalPodAutoscaler")["spec"]
    assert g["maxReplicas"] < k["maxReplicas"] and g["minReplicas"] <= k["minReplicas"]
    assert float(c["resources"]["requests"]["cpu"]) > float(container(cpu)["resources"]["requests"]["cpu"])


def test_prometheus_scrapes_what_the_dashboard_queries(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cpu"]
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert (
        service["spec"]["selector"].items() <= one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    )
    # the Prometheus Operator labels every series with these (instance = pod address:port)
    target_labels = {"instance", "job", "namespace", "pod", "service", "endpoint", "container"}
    metrics = [m for m in vars(Metrics()).values() if hasattr(m, "_labelnames")]
    own = {m._name: set(m._labelnames) for m in metrics}  # each family's own labels
    for query in dashboard.queries(dashboard.load()):
        for name, labels in dashboard.label_matchers(query.expr).items():
            family = re.sub(r"_(bucket|count|sum|total|created)$", "", name)
            assert labels <= target_labels | own.get(family, set()) | {"le", "quantile"}, (query.panel, name, labels)
