"""Version drift: which vLLM internals the plugin reads, checked once at load time.

The plugin reads vLLM's private scheduler types. If a vLLM release renames one
of them, the plugin must log one clear warning naming the version and disable
itself, rather than fail at run time inside the engine. This module lists
exactly what the hook reads and reports what the installed vLLM lacks.

What is checked: class attributes and dataclass fields (``SchedulerOutput``,
``NewRequestData``, ``CachedRequestData``), enum members (``RequestStatus``) and
properties (``Request.num_tokens``). Instance attributes assigned in a
constructor (``Request.num_prompt_tokens``) cannot be seen without an instance;
a drift there is still caught at run time by the hook's guards.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys

# module -> class -> the attributes the plugin reads (batch_stats, queue_tracker).
REQUIRED_INTERNALS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.v1.core.sched.output": {
        "SchedulerOutput": (
            "scheduled_new_reqs",
            "scheduled_cached_reqs",
            "num_scheduled_tokens",
            "total_num_scheduled_tokens",
            "scheduled_spec_decode_tokens",
        ),
        "NewRequestData": ("req_id", "prompt_token_ids", "num_computed_tokens"),
        "CachedRequestData": ("req_ids", "num_computed_tokens", "num_output_tokens"),
    },
    "vllm.v1.request": {
        # Status names that make a waiting request "queued decode" (queue_tracker).
        "RequestStatus": ("PREEMPTED", "WAITING_FOR_REMOTE_KVS"),
        "Request": ("num_tokens",),
    },
}


def vllm_version() -> str:
    """The installed vLLM's version string, for warnings; never raises."""
    try:
        vllm = sys.modules.get("vllm") or importlib.import_module("vllm")
        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - only used in messages
        return "unavailable"


def _has(cls: type, name: str) -> bool:
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    # Enum members, properties, methods, class-level defaults.
    return hasattr(cls, name)


def missing_internals(
    required: dict[str, dict[str, tuple[str, ...]]] = REQUIRED_INTERNALS,
) -> list[str]:
    """Dotted names of the required internals the installed vLLM lacks (empty: all there)."""
    missing: list[str] = []
    for module_name, classes in required.items():
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - any import problem is drift
            missing.append(module_name)
            continue
        for class_name, attributes in classes.items():
            cls = getattr(module, class_name, None)
            if not isinstance(cls, type):
                missing.append(f"{module_name}.{class_name}")
                continue
            missing += [
                f"{class_name}.{name}" for name in attributes if not _has(cls, name)
            ]
    return missing
