"""The Helm chart: ``helm lint`` and ``helm template`` (real helm v4), manifests validated.

helm comes from ``scripts/install_tools.sh`` (.tools/bin) or the PATH; without it
the tests skip, saying why, except under CI (``CI`` set), where that is a
failure. Rendered manifests are validated against the Kubernetes JSON schemas
bundled by ``kubernetes-validate`` (strict: unknown fields are errors) for the
built-in kinds, and against the ``openAPIV3Schema`` of their CRD (jsonschema,
draft 4, plus the list-map key check) for the custom resources whose CRD the
chart ships: ClusterKopfPeering, KopfPeering, and the example VllmDeployment.
The ServiceMonitor's CRD belongs to the Prometheus operator and is not here:
only its shape is checked. No API server is involved: admission, defaulting
and CEL only run in a real cluster.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from stepscale_operator.controller.permissions import required_rules

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "stepscale"
K8S_VERSION = "1.33.0"
IN_CI = bool(os.environ.get("CI"))


def missing(reason: str) -> None:
    """Skip for a missing tool, except under CI, where the tool must be there."""
    if IN_CI:
        pytest.fail(f"{reason} (CI is set: the chart tests must run)")
    pytest.skip(reason)


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
    missing(f"helm is not installed and scripts/install_tools.sh failed: {result.stderr[-300:]}")
    raise AssertionError("unreachable")


def import_or_missing(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        missing(f"{module} is needed for schema checks")


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


def render_error(helm: str, *args: str) -> str:
    """stderr of a ``helm template`` that must fail."""
    result = subprocess.run(
        [helm, "template", "rel", str(CHART), *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0, "the render should have failed"
    return result.stderr


# -- custom resources against their CRD ------------------------------------------------


def json_schema(node: Any) -> Any:
    """A CRD's OpenAPI v3 schema as JSON Schema (draft 4): ``nullable`` becomes a null type;
    ``x-kubernetes-*`` keys are left for :func:`list_map_problems` (jsonschema ignores them)."""
    if isinstance(node, list):
        return [json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: json_schema(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") and "type" in node:
        out["type"] = [node["type"], "null"]
    return out


def list_map_problems(value: Any, node: dict[str, Any], path: str = "") -> list[str]:
    """Duplicate keys in ``x-kubernetes-list-type: map`` lists (the API server refuses them)."""
    problems: list[str] = []
    if isinstance(value, list):
        keys = node.get("x-kubernetes-list-map-keys")
        if node.get("x-kubernetes-list-type") == "map" and keys:
            seen = [tuple(item.get(k) for k in keys) for item in value if isinstance(item, dict)]
            problems += [f"{path}: duplicate {k}" for k in set(seen) if seen.count(k) > 1]
        for i, item in enumerate(value):
            problems += list_map_problems(item, node.get("items", {}), f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            sub = (node.get("properties") or {}).get(k) or node.get("additionalProperties")
            if isinstance(sub, dict):
                problems += list_map_problems(v, sub, f"{path}.{k}")
    return problems


def crd_problems(obj: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """What the CRD's structural schema refuses in ``obj`` (no CEL, no defaulting)."""
    jsonschema = import_or_missing("jsonschema")
    version = obj["apiVersion"].split("/")[-1]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = served["schema"]["openAPIV3Schema"]
    validator = jsonschema.Draft4Validator(json_schema(schema))
    problems = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]
    return problems + list_map_problems(obj, schema)


def crds_by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (d["spec"]["group"], d["spec"]["names"]["kind"]): d
        for d in docs
        if d["kind"] == "CustomResourceDefinition"
    }


def validate(docs: list[dict[str, Any]]) -> None:
    """Built-in kinds: strict Kubernetes schemas; custom resources: their CRD from the render."""
    kv = import_or_missing("kubernetes_validate")
    crds = crds_by_kind(docs)
    for doc in docs:
        api_version = doc["apiVersion"]
        group = api_version.split("/")[0] if "/" in api_version else ""
        if (group, doc["kind"]) in crds:
            assert crd_problems(doc, crds[(group, doc["kind"])]) == [], doc["kind"]
        elif group == "monitoring.coreos.com":
            assert doc["kind"] == "ServiceMonitor" and doc["spec"]["endpoints"], doc
        else:
            kv.validate(copy.deepcopy(doc), K8S_VERSION, strict=True)


def vllmdeployment_crd() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "crds" / "vllmdeployment.yaml").read_text()))


# -- tests ----------------------------------------------------------------------------


def test_validation_catches_a_broken_manifest(helm: str) -> None:
    kv = import_or_missing("kubernetes_validate")
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
    assert "replicaCount" in render_error(helm, "--set", "replicaCount=0")


def test_a_service_monitor_needs_the_metrics_service(helm: str) -> None:
    stderr = render_error(
        helm, "--set", "serviceMonitor.enabled=true", "--set", "metrics.service.enabled=false"
    )
    assert "serviceMonitor.enabled=true needs metrics.service.enabled=true" in stderr


def test_kubernetes_older_than_1_28_is_refused(helm: str) -> None:
    """The CRD's CEL rules use fieldPath (Kubernetes 1.28+)."""
    crd_text = (CHART / "crds" / "vllmdeployment.yaml").read_text()
    assert "fieldPath:" in crd_text
    assert "kubeVersion" in render_error(helm, "--kube-version", "1.27.0")
    assert render(helm, "--kube-version", "1.28.0")


def granted_rules(role: dict[str, Any]) -> dict[tuple[str, str], frozenset[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return {key: frozenset(verbs) for key, verbs in granted.items()}


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
    # Exactly what the code uses (controller/permissions.py, checked against the requests
    # the operator makes in the kmock tests), nothing more.
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert granted_rules(role) == required_rules(namespaced=False)
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
        "watchNamespaces={llm,batch}",
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
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=llm" in args and "--namespace=batch" in args
    # Namespaced operators peer through a KopfPeering in each namespace they watch.
    peerings = [d for d in docs if d["kind"] in ("KopfPeering", "ClusterKopfPeering")]
    assert sorted((p["kind"], p["metadata"].get("namespace")) for p in peerings) == [
        ("KopfPeering", "batch"),
        ("KopfPeering", "llm"),
    ]
    # Namespaced RBAC: a Role and its RoleBinding in each watched namespace, exactly what
    # the operator needs there; nothing cluster-scoped.
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    roles = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Role"}
    bindings = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "RoleBinding"}
    assert set(roles) == set(bindings) == {"llm", "batch"}
    for ns, role in roles.items():
        assert granted_rules(role) == required_rules(namespaced=True), ns
        binding = bindings[ns]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "rel-stepscale", "namespace": "ops"}
        ]


def test_example_is_valid_against_the_crd() -> None:
    from stepscale_operator.controller.spec import parse_spec
    from tests.operator.test_status_and_crd import pruned, schema, types_ok

    example = yaml.safe_load((REPO / "examples" / "vllmdeployment.yaml").read_text())
    assert crd_problems(example, vllmdeployment_crd()) == []
    assert pruned(example["spec"], schema()["properties"]["spec"]) == example["spec"]
    assert types_ok(example["spec"], schema()["properties"]["spec"]) == []
    spec = parse_spec(example["spec"])
    assert spec.autoscaling.mode == "advisory"


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"resources": {"gpus": 1, "memory": "48 GB"}}, "does not match"),
        ({"resources": {"gpus": 1, "cpu": "-2"}}, "does not match"),
        ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "duplicate"),
        ({"autoscaling": {"mode": "yolo"}}, "is not one of"),
        ({"replicas": -1}, "less than the minimum"),
        ({"autoscaling": {"startupSeconds": 1e10}}, "greater than the maximum"),
    ],
)
def test_the_crd_refuses_what_the_api_server_would(change: dict[str, Any], fragment: str) -> None:
    """The CRD check above can fail: invalid VllmDeployments are refused, with the reason."""
    example = yaml.safe_load((REPO / "examples" / "vllmdeployment.yaml").read_text())
    example["spec"].update(change)
    problems = crd_problems(example, vllmdeployment_crd())
    assert any(fragment in p for p in problems), problems
