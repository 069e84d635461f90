"""A tiny random Llama for running a real vLLM engine without downloading weights.

Used by the end-to-end tests, the FPM recorder and the local demo. No weights
can be fetched on these machines, so the model is built locally from a config
with random weights; vLLM's CPU backend needs a head_dim it has kernels for
(hidden 128 with 4 heads gives 32).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
}


def build_tiny_llama(
    directory: str | Path, seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write a random-weight Llama (safetensors + config) into ``directory``; idempotent.

    ``overrides`` change :data:`TINY_LLAMA_CONFIG` (e.g. a bigger model for the
    recorder); the directory is rebuilt when its config differs.
    """
    path = Path(directory)
    marker = path / "stepscale_tiny_model.json"
    wanted = {**TINY_LLAMA_CONFIG, **(overrides or {})}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**wanted)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(wanted))
    return path
