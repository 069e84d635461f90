"""The Helm chart: ``helm lint`` and ``helm template`` (real helm v4), manifests validated.

helm comes from ``scripts/install_tools.sh`` (.tools/bin) or the PATH; the tests
skip, saying why, only when neither has it. Rendered manifests are validated
against the Kubernetes JSON schemas bundled by ``kubernetes-validate`` (strict:
unknown fields are errors) for the built-in kinds; the CRDs and custom
resources (VllmDeployment, ClusterKopfPeering, ServiceMonitor) are checked
against their own schemas here. No API server is involved: admission,
defaulting and CEL only run in a real cluster.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "stepscale"
K8S_VERSION = "1.33.0"


def helm_binary() -> str:
    local = REPO / ".tools" / "bin" / "helm"
    if local.exists():
        return str(local)
    found = shutil.which("helm")
    if found:
        return found
    script = REPO / "scripts" / "install_tools.sh"
    result = subprocess.run([str(script)], capture_output=True, text=True, timeout=300)
    if result.returncode == 0 and local.exists():
        return str(local)
    pytest.skip(
        f"helm is not installed and scripts/install_tools.sh failed: {result.stderr[-300:]}"
    )


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()


def render(helm: str, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [helm, "template", "rel", str(CHART), "--namespace", "ops", "--include-crds", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


CUSTOM_GROUPS = {"stepscale.io", "kopf.dev", "monitoring.coreos.com"}


def validate(docs: list[dict[str, Any]]) -> None:
    """Strict schema validation of every built-in kind (custom resources are skipped)."""
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is needed for schema checks"
    )
    for doc in docs:
        api_version = doc["apiVersion"]
        group = api_version.split("/")[0] if "/" in api_version else ""
        if group in CUSTOM_GROUPS:
            continue
        kv.validate(copy.deepcopy(doc), K8S_VERSION, strict=True)


def test_validation_catches_a_broken_manifest(helm: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    dep = next(d for d in render(helm) if d["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["portz"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSION, strict=True)


def test_lint_default_and_custom_values(helm: str, tmp_path: Path) -> None:
    subprocess.run(
        [helm, "lint", "--strict", str(CHART)], check=True, timeout=120, capture_output=True
    )
    custom = tmp_path / "values.yaml"
    custom.write_text(
        yaml.safe_dump(
            {
                "replicaCount": 3,
                "watchNamespaces": ["llm", "batch"],
                "networkPolicy": {"enabled": True, "namespaces": ["llm", "batch"]},
                "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                "logLevel": "debug",
            }
        )
    )
    subprocess.run(
        [helm, "lint", "--strict", str(CHART), "-f", str(custom)],
        check=True,
        timeout=120,
        capture_output=True,
    )


def test_values_schema_refuses_bad_values(helm: str) -> None:
    result = subprocess.run(
        [helm, "template", "rel", str(CHART), "--set", "replicaCount=0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "replicaCount" in result.stderr


def test_default_render_is_valid_and_least_privilege(helm: str) -> None:
    docs = render(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "CustomResourceDefinition",
            "CustomResourceDefinition",
            "CustomResourceDefinition",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterKopfPeering",
            "Deployment",
            "Service",
        ]
    )
    validate(docs)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 2
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["stepscale", "operator"]
    assert "--peering=stepscale" in container["args"]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    granted = {
        (g, r): sorted(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert granted[("apps", "deployments")] == ["create", "get", "patch"]
    assert granted[("", "pods")] == ["list", "watch"]
    assert granted[("", "events")] == ["create"]
    assert ("", "secrets") not in granted
    assert not any("*" in verbs for verbs in granted.values())
    crd_in_chart = (CHART / "crds" / "vllmdeployment.yaml").read_text()
    assert crd_in_chart == (REPO / "crds" / "vllmdeployment.yaml").read_text(), (
        "charts/stepscale/crds/vllmdeployment.yaml must be a copy of crds/vllmdeployment.yaml"
    )


def test_custom_render_adds_policy_monitor_and_namespaces(helm: str) -> None:
    docs = render(
        helm,
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "networkPolicy.namespaces={llm,batch}",
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "watchNamespaces={llm}",
        "--set",
        "metrics.service.enabled=true",
    )
    validate(docs)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["batch", "llm"]
    fpm_rule, api_rule = policies[0]["spec"]["ingress"]
    assert fpm_rule["ports"][0]["port"] == 20380 and fpm_rule["ports"][0]["endPort"] == 20387
    peer = fpm_rule["from"][0]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ops"}
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert "from" not in api_rule and api_rule["ports"][0]["port"] == 8000
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert "--namespace=llm" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    # Namespaced operators peer through a KopfPeering in each namespace they watch.
    peerings = [d for d in docs if d["kind"] in ("KopfPeering", "ClusterKopfPeering")]
    assert [(p["kind"], p["metadata"].get("namespace")) for p in peerings] == [
        ("KopfPeering", "llm")
    ]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert {
        "apiGroups": ["kopf.dev"],
        "resources": ["kopfpeerings"],
        "verbs": ["list", "watch", "patch", "get"],
    } in role["rules"]


def test_example_is_valid_against_the_crd() -> None:
    from stepscale_operator.controller.spec import parse_spec
    from tests.operator.test_status_and_crd import pruned, schema, types_ok

    example = yaml.safe_load((REPO / "examples" / "vllmdeployment.yaml").read_text())
    assert pruned(example["spec"], schema()["properties"]["spec"]) == example["spec"]
    assert types_ok(example["spec"], schema()["properties"]["spec"]) == []
    spec = parse_spec(example["spec"])
    assert spec.autoscaling.mode == "advisory"
