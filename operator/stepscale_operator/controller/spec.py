"""``VllmDeployment`` spec: parsing, defaults and validation (pure).

The CRD (``crds/vllmdeployment.yaml``) is the first line of defence: a real API
server applies its defaults and refuses what its schema and CEL rules refuse.
This module applies the same defaults and checks the same rules, with the same
messages, so that an object that slipped past (an older CRD, a server that does
not evaluate CEL, a test API server) gets a ``Degraded`` condition with a
message that says what to fix instead of crashing the operator.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepscale_operator.cost_model import COEFFICIENT_NAMES

GROUP = "stepscale.io"
VERSION = "v1alpha1"
PLURAL = "vllmdeployments"
KIND = "VllmDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

MODES = ("auto", "advisory")
# How requests reach the pods: the operator's Service spreads them at random
# (kube-proxy); a load-aware gateway in front balances them (least outstanding).
ROUTINGS = ("random", "balanced")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
RESERVED_ENV_PREFIX = "STEPSCALE_FPM_"
DEFAULT_FPM_BASE_PORT = 20380
MAX_DATA_PARALLEL = 64
# A day: longer is a typo (1e10 overflowed the startup probe's int32 failureThreshold).
MAX_STARTUP_S = 86400.0
# spec.autoscaling.initialCoefficients keys (camelCase) -> cost model coefficient names
# (decode_requests -> decodeRequests, compute.tokens -> computeTokens).
COEFFICIENT_FIELDS: dict[str, str] = {
    "".join(w if i == 0 else w.capitalize() for i, w in enumerate(re.split(r"[._]", name))): name
    for name in COEFFICIENT_NAMES
}

# Messages shared with the CRD's x-kubernetes-validations (keep them identical).
MSG_MIN_MAX = (
    "autoscaling.minReplicas must be <= autoscaling.maxReplicas: "
    "lower minReplicas or raise maxReplicas"
)
MSG_GPUS = (
    "resources.gpus must be 0 (CPU) or tensorParallelSize * dataParallelSize: "
    "set gpus to that product or change the parallel sizes"
)
MSG_PORT_OVERLAP = (
    "the FPM ports fpm.basePort .. fpm.basePort + dataParallelSize - 1 must not include "
    "port: move fpm.basePort or port"
)
MSG_PORT_RANGE = "fpm.basePort + dataParallelSize - 1 must be <= 65535: lower fpm.basePort"
MSG_SEQS_TOKENS = (
    "engine.maxNumSeqs must be <= engine.maxNumBatchedTokens (vLLM refuses it otherwise): "
    "raise maxNumBatchedTokens or lower maxNumSeqs"
)
# A Kubernetes resource quantity (500m, 4, 16Gi, 1e3), the same pattern as the CRD's
# resources.cpu/memory (no backslashes: it reads the same in Go's RE2 and in Python).
QUANTITY_PATTERN = (
    "^[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)"
    "([KMGTPE]i|[numkMGTPE]|[eE][+-]?([0-9]+([.][0-9]*)?|[.][0-9]+))?$"
)
_QUANTITY = re.compile(QUANTITY_PATTERN)
MSG_RESERVED_ENV = (
    "env must not set STEPSCALE_FPM_* variables: the operator sets them from fpm and the pod name"
)
# metadata.name: the child Service is named after it (a DNS-1035 label) and the pods'
# selector label carries it (at most 63 characters). The CRD checks the same.
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
_NAME = re.compile(NAME_PATTERN)
MAX_NAME_LENGTH = 63
MSG_NAME_LENGTH = (
    "metadata.name must be at most 63 characters: the Service and the pods' selector "
    "label are named after it"
)
MSG_NAME_LABEL = (
    "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting "
    "with a letter and ending with a letter or digit; no dots): the Service is named after it"
)


def name_problems(name: str) -> list[str]:
    """What is wrong with a ``VllmDeployment``'s name (the CRD's rules on metadata.name)."""
    if len(name) > MAX_NAME_LENGTH:
        return [f"{MSG_NAME_LENGTH} ({name!r} has {len(name)})"]
    if not _NAME.match(name):
        return [f"{MSG_NAME_LABEL} (got {name!r})"]
    return []


class SpecError(ValueError):
    """A spec that cannot be used; ``problems`` lists each one as ``path: what to fix``."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class SloSpec:
    """Latency targets in milliseconds."""

    ttft_ms: float = 1000.0
    itl_ms: float = 50.0


@dataclass(frozen=True)
class CostModelSpec:
    """Settings of the online step-time model."""

    half_life_passes: float = 20000.0
    warmup_passes: int = 20
    min_samples: int = 200
    initial_coefficients: dict[str, float] | None = None  # coefficient name -> s per unit


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``."""

    enabled: bool = True
    mode: str = "auto"
    min_replicas: int = 1
    max_replicas: int = 8
    interval_s: float = 10.0
    slo: SloSpec = field(default_factory=SloSpec)
    max_surge: int = 8
    scale_down_stabilization_s: float = 120.0
    scale_down_initial_hold_s: float = 300.0
    scale_down_max_step: int = 1
    burst_memory_s: float = 900.0
    recurring_bursts: int = 3
    routing: str = "random"
    startup_s: float = 120.0
    load_window_s: float = 30.0
    stale_after_s: float = 3.0
    cost_model: CostModelSpec = field(default_factory=CostModelSpec)

    @property
    def advisory(self) -> bool:
        """True when decisions are explained but never applied."""
        return self.mode == "advisory"


@dataclass(frozen=True)
class EngineSpec:
    """vLLM engine arguments the operator knows about, plus extra ones."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_capacity_tokens: int = 400_000
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResourcesSpec:
    """GPUs per pod and optional CPU/memory requests (Kubernetes quantities)."""

    gpus: int = 1
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class PodTemplateOverrides:
    """``spec.podTemplate``: what a user may add to the pods."""

    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    service_account_name: str | None = None
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    image_pull_secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class VllmDeploymentSpec:
    """A parsed, defaulted and validated ``VllmDeployment`` spec."""

    model: str
    image: str
    served_model_name: str | None = None
    image_pull_policy: str = "IfNotPresent"
    replicas: int = 1
    port: int = 8000
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    fpm_base_port: int = DEFAULT_FPM_BASE_PORT
    engine: EngineSpec = field(default_factory=EngineSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    env: tuple[dict[str, Any], ...] = ()
    pod_template: PodTemplateOverrides = field(default_factory=PodTemplateOverrides)
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)

    @property
    def fpm_ports(self) -> list[int]:
        """The FPM port of each data-parallel rank."""
        return [self.fpm_base_port + r for r in range(self.data_parallel_size)]

    def mode(self) -> str:
        """``auto``, ``advisory`` or ``disabled``: who sets the replica count."""
        return self.autoscaling.mode if self.autoscaling.enabled else "disabled"

    def initial_replicas(self) -> int:
        """Replicas to start with: ``spec.replicas``, clamped to the autoscaling range."""
        a = self.autoscaling
        if not a.enabled:
            return self.replicas
        return min(max(self.replicas, a.min_replicas), a.max_replicas)


class _Reader:
    """Reads typed fields out of a mapping, collecting problems instead of raising."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems

    def section(self, raw: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
        value = raw.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.problems.append(f"{path}.{key}: must be an object")
            return {}
        return value

    def string(
        self,
        raw: Mapping[str, Any],
        key: str,
        path: str,
        default: str | None = None,
        *,
        required: bool = False,
        choices: Sequence[str] = (),
    ) -> str | None:
        value = raw.get(key)
        if value is None:
            if required:
                self.problems.append(f"{path}.{key}: is required")
            return default
        if not isinstance(value, str) or (required and not value.strip()):
            self.problems.append(f"{path}.{key}: must be a non-empty string")
            return default
        if choices and value not in choices:
            self.problems.append(
                f"{path}.{key}: must be one of {', '.join(choices)} (got {value!r})"
            )
            return default
        return value

    def integer(
        self,
        raw: Mapping[str, Any],
        key: str,
        path: str,
        default: int,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> int:
        value = raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.problems.append(f"{path}.{key}: must be an integer (got {value!r})")
            return default
        return self._in_range(value, key, path, default, minimum, maximum)

    def number(
        self,
        raw: Mapping[str, Any],
        key: str,
        path: str,
        default: float,
        minimum: float | None = None,
        maximum: float | None = None,
        *,
        exclusive_minimum: bool = False,
    ) -> float:
        value = raw.get(key)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            self.problems.append(f"{path}.{key}: must be a number (got {value!r})")
            return default
        if exclusive_minimum and minimum is not None and value <= minimum:
            self.problems.append(f"{path}.{key}: must be > {minimum} (got {value})")
            return default
        return float(self._in_range(value, key, path, default, minimum, maximum))

    def boolean(self, raw: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
        value = raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.problems.append(f"{path}.{key}: must be true or false (got {value!r})")
            return default
        return value

    def string_map(self, raw: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
        value = raw.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            self.problems.append(f"{path}.{key}: must be a map of strings to strings")
            return {}
        return dict(value)

    def object_list(
        self, raw: Mapping[str, Any], key: str, path: str
    ) -> tuple[dict[str, Any], ...]:
        value = raw.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            self.problems.append(f"{path}.{key}: must be a list of objects")
            return ()
        return tuple(dict(v) for v in value)

    def string_list(self, raw: Mapping[str, Any], key: str, path: str) -> tuple[str, ...]:
        value = raw.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.problems.append(f"{path}.{key}: must be a list of strings")
            return ()
        return tuple(value)

    def _in_range(
        self,
        value: float,
        key: str,
        path: str,
        default: Any,
        minimum: float | None,
        maximum: float | None,
    ) -> Any:
        if minimum is not None and value < minimum:
            self.problems.append(f"{path}.{key}: must be >= {minimum} (got {value})")
            return default
        if maximum is not None and value > maximum:
            self.problems.append(f"{path}.{key}: must be <= {maximum} (got {value})")
            return default
        return value


def default_gpus(raw: Mapping[str, Any]) -> int:
    """``resources.gpus`` when not given: one per rank, tensorParallelSize * dataParallelSize
    (1 when either is not a positive integer: the parser reports that)."""
    sizes = [raw.get("tensorParallelSize", 1), raw.get("dataParallelSize", 1)]
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
        return int(sizes[0] * sizes[1])
    return 1


def parse_spec(raw: Mapping[str, Any] | None) -> VllmDeploymentSpec:
    """Parse ``.spec`` of a ``VllmDeployment``; raises :class:`SpecError` listing every problem."""
    problems: list[str] = []
    if raw is None or not isinstance(raw, Mapping):
        raise SpecError(["spec: is required and must be an object"])
    r = _Reader(problems)
    p = "spec"
    model = r.string(raw, "model", p, "", required=True) or ""
    image = r.string(raw, "image", p, "", required=True) or ""

    eng = r.section(raw, "engine", p)
    ep = f"{p}.engine"
    engine = EngineSpec(
        max_num_batched_tokens=r.integer(eng, "maxNumBatchedTokens", ep, 2048, 1),
        max_num_seqs=r.integer(eng, "maxNumSeqs", ep, 256, 1),
        max_model_len=(
            r.integer(eng, "maxModelLen", ep, 0, 1) or None if "maxModelLen" in eng else None
        ),
        gpu_memory_utilization=(
            r.number(eng, "gpuMemoryUtilization", ep, 0.9, 0.0, 1.0, exclusive_minimum=True)
            if "gpuMemoryUtilization" in eng
            else None
        ),
        kv_capacity_tokens=r.integer(eng, "kvCapacityTokens", ep, 400_000, 1),
        extra_args=r.string_list(eng, "extraArgs", ep),
    )

    res = r.section(raw, "resources", p)
    resources = ResourcesSpec(
        gpus=r.integer(res, "gpus", f"{p}.resources", default_gpus(raw), 0),
        cpu=_quantity(r, res, "cpu", f"{p}.resources"),
        memory=_quantity(r, res, "memory", f"{p}.resources"),
    )

    pt = r.section(raw, "podTemplate", p)
    pp = f"{p}.podTemplate"
    affinity = pt.get("affinity")
    if affinity is not None and not isinstance(affinity, Mapping):
        problems.append(f"{pp}.affinity: must be an object")
        affinity = None
    pod_template = PodTemplateOverrides(
        labels=r.string_map(pt, "labels", pp),
        annotations=r.string_map(pt, "annotations", pp),
        node_selector=r.string_map(pt, "nodeSelector", pp),
        tolerations=r.object_list(pt, "tolerations", pp),
        affinity=dict(affinity) if affinity is not None else None,
        service_account_name=r.string(pt, "serviceAccountName", pp),
        priority_class_name=r.string(pt, "priorityClassName", pp),
        runtime_class_name=r.string(pt, "runtimeClassName", pp),
        image_pull_secrets=r.string_list(pt, "imagePullSecrets", pp),
    )

    fpm = r.section(raw, "fpm", p)
    spec = VllmDeploymentSpec(
        model=model,
        image=image,
        served_model_name=r.string(raw, "servedModelName", p),
        image_pull_policy=r.string(raw, "imagePullPolicy", p, "IfNotPresent", choices=PULL_POLICIES)
        or "IfNotPresent",
        replicas=r.integer(raw, "replicas", p, 1, 0),
        port=r.integer(raw, "port", p, 8000, 1, 65535),
        tensor_parallel_size=r.integer(raw, "tensorParallelSize", p, 1, 1),
        data_parallel_size=r.integer(raw, "dataParallelSize", p, 1, 1, MAX_DATA_PARALLEL),
        fpm_base_port=r.integer(fpm, "basePort", f"{p}.fpm", DEFAULT_FPM_BASE_PORT, 1, 65535),
        engine=engine,
        resources=resources,
        env=r.object_list(raw, "env", p),
        pod_template=pod_template,
        autoscaling=_parse_autoscaling(r, r.section(raw, "autoscaling", p), f"{p}.autoscaling"),
    )
    problems.extend(cross_field_problems(spec))
    if problems:
        raise SpecError(problems)
    return spec


def _quantity(r: _Reader, raw: Mapping[str, Any], key: str, path: str) -> str | None:
    """A Kubernetes quantity string, or None (absent or invalid, reported)."""
    value = r.string(raw, key, path)
    if value is not None and not _QUANTITY.match(value):
        r.problems.append(
            f"{path}.{key}: {value!r} is not a Kubernetes quantity; "
            "write it like 500m, 4, 16Gi or 64G"
        )
        return None
    return value


def _parse_autoscaling(r: _Reader, raw: Mapping[str, Any], p: str) -> AutoscalingSpec:
    slo = r.section(raw, "slo", p)
    up = r.section(raw, "scaleUp", p)
    down = r.section(raw, "scaleDown", p)
    bursts = r.section(raw, "bursts", p)
    metrics = r.section(raw, "metrics", p)
    cm = r.section(raw, "costModel", p)
    cmp = f"{p}.costModel"
    initial: dict[str, float] | None = None
    raw_coef = cm.get("initialCoefficients")
    if raw_coef is not None:
        if not isinstance(raw_coef, Mapping):
            r.problems.append(f"{cmp}.initialCoefficients: must be an object")
        else:
            initial = {}
            for key in raw_coef:
                if key not in COEFFICIENT_FIELDS:
                    r.problems.append(
                        f"{cmp}.initialCoefficients.{key}: unknown coefficient; use one of "
                        + ", ".join(COEFFICIENT_FIELDS)
                    )
                    continue
                initial[COEFFICIENT_FIELDS[key]] = r.number(
                    raw_coef, key, f"{cmp}.initialCoefficients", 0.0, 0.0
                )
    return AutoscalingSpec(
        enabled=r.boolean(raw, "enabled", p, True),
        mode=r.string(raw, "mode", p, "auto", choices=MODES) or "auto",
        min_replicas=r.integer(raw, "minReplicas", p, 1, 0),
        max_replicas=r.integer(raw, "maxReplicas", p, 8, 1),
        interval_s=r.number(raw, "intervalSeconds", p, 10.0, 1.0),
        slo=SloSpec(
            ttft_ms=r.number(slo, "ttftMs", f"{p}.slo", 1000.0, 0.0, exclusive_minimum=True),
            itl_ms=r.number(slo, "itlMs", f"{p}.slo", 50.0, 0.0, exclusive_minimum=True),
        ),
        max_surge=r.integer(up, "maxSurge", f"{p}.scaleUp", 8, 1),
        scale_down_stabilization_s=r.number(
            down, "stabilizationWindowSeconds", f"{p}.scaleDown", 120.0, 0.0
        ),
        scale_down_initial_hold_s=r.number(
            down, "initialHoldSeconds", f"{p}.scaleDown", 300.0, 0.0
        ),
        scale_down_max_step=r.integer(down, "maxStep", f"{p}.scaleDown", 1, 1),
        burst_memory_s=r.number(bursts, "memorySeconds", f"{p}.bursts", 900.0, 0.0),
        recurring_bursts=r.integer(bursts, "recurringAfter", f"{p}.bursts", 3, 0),
        routing=r.string(raw, "routing", p, "random", choices=ROUTINGS) or "random",
        startup_s=r.number(raw, "startupSeconds", p, 120.0, 0.0, MAX_STARTUP_S),
        load_window_s=r.number(metrics, "windowSeconds", f"{p}.metrics", 30.0, 1.0),
        stale_after_s=r.number(metrics, "staleAfterSeconds", f"{p}.metrics", 3.0, 1.0),
        cost_model=CostModelSpec(
            half_life_passes=r.number(cm, "halfLifePasses", cmp, 20000.0, 1.0),
            warmup_passes=r.integer(cm, "warmupPasses", cmp, 20, 0),
            min_samples=r.integer(cm, "minSamples", cmp, 200, 1),
            initial_coefficients=initial,
        ),
    )


def cross_field_problems(spec: VllmDeploymentSpec) -> list[str]:
    """The CRD's CEL rules, evaluated on a parsed spec (same messages)."""
    problems: list[str] = []
    a = spec.autoscaling
    if a.min_replicas > a.max_replicas:
        problems.append(f"spec: {MSG_MIN_MAX} (min {a.min_replicas}, max {a.max_replicas})")
    parallel = spec.tensor_parallel_size * spec.data_parallel_size
    if spec.resources.gpus not in (0, parallel):
        problems.append(f"spec: {MSG_GPUS} (gpus {spec.resources.gpus}, product {parallel})")
    last_fpm = spec.fpm_base_port + spec.data_parallel_size - 1
    if last_fpm > 65535:
        problems.append(f"spec: {MSG_PORT_RANGE}")
    elif spec.fpm_base_port <= spec.port <= last_fpm:
        problems.append(f"spec: {MSG_PORT_OVERLAP} (port {spec.port})")
    if spec.engine.max_num_seqs > spec.engine.max_num_batched_tokens:
        problems.append(f"spec: {MSG_SEQS_TOKENS}")
    reserved = [
        str(e.get("name"))
        for e in spec.env
        if str(e.get("name", "")).startswith(RESERVED_ENV_PREFIX)
    ]
    if reserved:
        problems.append(f"spec: {MSG_RESERVED_ENV} (found {', '.join(reserved)})")
    unnamed = [i for i, e in enumerate(spec.env) if not isinstance(e.get("name"), str)]
    if unnamed:
        problems.append(f"spec.env[{unnamed[0]}].name: is required")
    names = [str(e["name"]) for e in spec.env if isinstance(e.get("name"), str)]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.append(
            f"spec.env: {', '.join(duplicates)} set more than once; keep one entry per name"
        )
    return problems
