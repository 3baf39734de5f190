"""What kind of KV-cache group a vLLM spec describes, for the other vLLM adapters."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs


def unwrap_spec(spec: Any) -> Any:
    """A group of uniform-type layers carries one spec per layer; they are all alike."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return next(iter(spec.kv_cache_specs.values()))
    return spec


def is_recurrent(spec: Any) -> bool:
    """Mamba / linear attention: one state per boundary rather than KV per token."""
    return isinstance(unwrap_spec(spec), MambaSpec)
