"""The objects a ``VllmDeployment`` owns, built from its spec (pure).

* a Deployment running ``python -m vllm.entrypoints.openai.api_server`` with the
  Stepscale engine plugin switched on through the environment
  (``STEPSCALE_FPM_PORT``), the stream identity taken from the pod name through
  the downward API (``STEPSCALE_FPM_WORKER_ID``), one named container port per
  data-parallel rank (``fpm-0``, ``fpm-1``, ...) and a readiness probe on ``/health``;
* a Service for the OpenAI API.

Both carry an owner reference to the ``VllmDeployment`` (deletion cascades) and
the label :data:`INSTANCE_LABEL`, which selects the pods.
"""

from __future__ import annotations

from typing import Any

from stepscale_operator.controller.spec import API_VERSION, KIND, VllmDeploymentSpec

INSTANCE_LABEL = "stepscale.io/vllmdeployment"
MANAGED_BY = "stepscale-operator"
CONTAINER_NAME = "vllm"
API_PORT_NAME = "http"
FIELD_MANAGER = "stepscale-operator"


def fpm_port_name(rank: int) -> str:
    """Name of the container port of data-parallel rank ``rank`` (at most 15 characters)."""
    return f"fpm-{rank}"


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select the pods of the ``VllmDeployment`` ``name``."""
    return {INSTANCE_LABEL: name}


def selector_string(name: str) -> str:
    """The same selector as a string, for ``status.selector`` (scale subresource, HPA)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def common_labels(name: str) -> dict[str, str]:
    """Labels of every child object."""
    return {
        "app.kubernetes.io/name": "vllm",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(name),
    }


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """Controller owner reference to the ``VllmDeployment`` ``name``/``uid``."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(name: str, namespace: str, uid: str) -> dict[str, Any]:
    """Metadata of a child object: same name and namespace, labelled and owned by it."""
    return {
        "name": name,
        "namespace": namespace,
        "labels": common_labels(name),
        "ownerReferences": [owner_reference(name, uid)],
    }


def vllm_args(spec: VllmDeploymentSpec) -> list[str]:
    """Arguments of ``python -m vllm.entrypoints.openai.api_server``."""
    e = spec.engine
    args = [
        "--model",
        spec.model,
        "--host",
        "0.0.0.0",
        "--port",
        str(spec.port),
        "--tensor-parallel-size",
        str(spec.tensor_parallel_size),
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
        "--max-num-seqs",
        str(e.max_num_seqs),
    ]
    if spec.data_parallel_size > 1:
        args += ["--data-parallel-size", str(spec.data_parallel_size)]
    if spec.served_model_name:
        args += ["--served-model-name", spec.served_model_name]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    if e.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    return args + list(e.extra_args)


def plugin_env(spec: VllmDeploymentSpec) -> list[dict[str, Any]]:
    """Environment that switches the engine plugin on; the pod name is the stream identity."""
    pod_name = {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}}
    return [
        {"name": "POD_NAME", **pod_name},
        {"name": "STEPSCALE_FPM_WORKER_ID", **pod_name},
        {"name": "STEPSCALE_FPM_PORT", "value": str(spec.fpm_base_port)},
    ]


def container(spec: VllmDeploymentSpec) -> dict[str, Any]:
    """The vLLM container."""
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if spec.resources.gpus > 0:
        limits["nvidia.com/gpu"] = str(spec.resources.gpus)
    if spec.resources.cpu:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory:
        requests["memory"] = spec.resources.memory
        limits["memory"] = spec.resources.memory
    user_env = [e for e in spec.env if e.get("name") not in ("POD_NAME",)]
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = limits
    if requests:
        resources["requests"] = requests
    ports = [{"name": API_PORT_NAME, "containerPort": spec.port, "protocol": "TCP"}] + [
        {"name": fpm_port_name(r), "containerPort": port, "protocol": "TCP"}
        for r, port in enumerate(spec.fpm_ports)
    ]
    return {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["python", "-m", "vllm.entrypoints.openai.api_server"],
        "args": vllm_args(spec),
        "env": plugin_env(spec) + user_env,
        "ports": ports,
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": API_PORT_NAME},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        # Model loading takes a while: only start liveness checks once it answered.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": API_PORT_NAME},
            "periodSeconds": 10,
            "failureThreshold": max(6, int(spec.autoscaling.startup_s // 10) * 3),
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": API_PORT_NAME},
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
        "resources": resources,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }


# On the child Deployment: the autoscaling mode it was last applied in. Leaving auto
# keeps the count the operator set, even when the spec was invalid in between or
# status was lost (it survives both).
MODE_ANNOTATION = "stepscale.io/applied-mode"


def applied_mode(deployment: dict[str, Any] | None) -> str | None:
    """The mode a child Deployment was last applied in (None: unknown)."""
    annotations = ((deployment or {}).get("metadata") or {}).get("annotations") or {}
    mode = annotations.get(MODE_ANNOTATION)
    return mode if isinstance(mode, str) else None


def build_deployment(
    name: str, namespace: str, uid: str, spec: VllmDeploymentSpec, replicas: int
) -> dict[str, Any]:
    """The child Deployment of ``VllmDeployment`` ``namespace/name`` with ``replicas`` pods."""
    pt = spec.pod_template
    pod_spec: dict[str, Any] = {
        "containers": [container(spec)],
        # Tensor parallelism shares memory between worker processes through /dev/shm.
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "terminationGracePeriodSeconds": 60,
    }
    if pt.node_selector:
        pod_spec["nodeSelector"] = dict(pt.node_selector)
    if pt.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in pt.tolerations]
    if pt.affinity:
        pod_spec["affinity"] = dict(pt.affinity)
    if pt.service_account_name:
        pod_spec["serviceAccountName"] = pt.service_account_name
    if pt.priority_class_name:
        pod_spec["priorityClassName"] = pt.priority_class_name
    if pt.runtime_class_name:
        pod_spec["runtimeClassName"] = pt.runtime_class_name
    if pt.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in pt.image_pull_secrets]
    pod_labels = {**pt.labels, **common_labels(name)}
    pod_metadata: dict[str, Any] = {"labels": pod_labels}
    if pt.annotations:
        pod_metadata["annotations"] = dict(pt.annotations)
    metadata = child_metadata(name, namespace, uid)
    metadata["annotations"] = {MODE_ANNOTATION: spec.mode()}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name)},
            # Never take serving capacity away during a rollout: surge one pod at a time.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {"metadata": pod_metadata, "spec": pod_spec},
        },
    }


def build_service(name: str, namespace: str, uid: str, spec: VllmDeploymentSpec) -> dict[str, Any]:
    """The Service for the OpenAI API of ``VllmDeployment`` ``namespace/name``."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(name, namespace, uid),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [
                {
                    "name": API_PORT_NAME,
                    "port": spec.port,
                    "targetPort": API_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }
