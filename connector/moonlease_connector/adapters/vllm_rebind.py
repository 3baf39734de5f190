"""Upstream's own functions run with some of the classes they name replaced, for one call.

I/O adapter helper. Upstream's connector constructor and its worker's `register_kv_caches`
build their parts by global name (`MooncakeStoreWorker`, `KVCacheStoreRecvingThread`, ...);
Moonlease substitutes its own parts by calling a copy of upstream's function whose globals bind
those names to ours. Nothing global changes, so upstream's classes used elsewhere in the same
process are unaffected, and none of upstream's code is copied.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


def with_replaced_globals(function: Callable[..., Any],
                          replacements: dict[str, tuple[Any, Any]]) -> types.FunctionType:
    """`function` with the globals it names replaced: `replacements` maps a global name to
    (upstream's object, ours). The name is resolved as upstream's module holds it now; only
    upstream's own object is swapped for ours, so whatever else is bound there (a test double
    patched in) is used as upstream would use it. The function's code, defaults and closure
    (the `__class__` cell a `super()` reads) are upstream's.

    Raises RuntimeError when the function no longer names one of them (a vLLM we do not support).
    """
    assert isinstance(function, types.FunctionType)
    missing = [name for name in replacements if name not in function.__code__.co_names]
    if missing:
        raise RuntimeError(f"this vLLM's {function.__qualname__} no longer builds "
                           f"{', '.join(missing)} by name; Moonlease does not support it")
    bound = dict(function.__globals__)
    for name, (upstream, ours) in replacements.items():
        if bound.get(name) is upstream:
            bound[name] = ours
    return types.FunctionType(function.__code__, bound, function.__name__, function.__defaults__,
                              function.__closure__)
