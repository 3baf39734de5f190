"""Configuration hashes: short, stable names for a rendered configuration. Pure.

A hash goes into the pod template's `moonlease.io/config-hash` annotation (so a configuration
that lives outside the template, such as the master's ConfigMap, still triggers the workload's
own rolling update) and into the policy status (`desiredConfigHash`, `appliedConfigHash`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

HASH_LENGTH = 16


def build_config_hash(value: Any) -> str:
    """SHA-256 of `value` as canonical JSON (sorted keys, no spaces), first 16 hex digits.

    Equal values give equal hashes whatever their key order; anything JSON cannot encode
    natively is encoded with `str` (enums, datetimes).
    """
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:HASH_LENGTH]
