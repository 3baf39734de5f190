"""Retention ``evict`` with one recency order for the fleet: the fleet order service's wire and rules.

Pure: no HTTP, no Mooncake. The service (`adapters.fleet_order_server`) holds one
`store_room.RecencyOrder` for every engine of a Mooncake store and applies the operations its
clients (`adapters.fleet_order_client`) send, in the order they arrive; what each operation
means lives here.

Why. Per-engine evict orders only the keys its own saves touched: with several engines on one
store, keys another engine loads every second look the least recently used here, and the
decode engines, which read every prompt, order nothing. The master's own first eviction pass is
close to random below about 200 objects per metadata shard. One order fed by every engine's
saves and loads, asked for victims before each put that needs room, is the exact fleet-wide
least-recently-used the recency ceiling measures (benchmarks/results/recency_ceiling.md).

Operations (a client batches what it has queued into one request, applied in order):
- ``touch``: a save stored or re-checked these keys (prompt order, sizes, which are shared);
- ``refresh``: a load read these keys (prompt order): those the order holds are used now;
- ``take``: the oldest keys worth ``free_bytes`` (never ``protect``, never shared), taken out of
  the order; the caller removes them from the store;
- ``keep``: keys a removal refused (under lease: being read), most recent again.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moonlease_connector.core.store_room import RecencyOrder

#: Keys one operation may name: a prompt of a million tokens in 16-token blocks, 8 groups.
MAX_KEYS_PER_OPERATION = 1 << 19
#: Operations one request may carry (a client's queue drained at once).
MAX_OPERATIONS_PER_REQUEST = 4096

Keys = Annotated[list[str], Field(max_length=MAX_KEYS_PER_OPERATION)]


class _Operation(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Touch(_Operation):
    op: Literal["touch"] = "touch"
    keys: Keys
    #: Bytes per key (None: keep what is known); as long as `keys` when given.
    sizes: list[int | None] | None = None
    #: Those of `keys` in the prompt's shared prefix (None: a read that does not know).
    shared: Keys | None = None

    @model_validator(mode="after")
    def _a_size_per_key(self) -> Touch:
        # Checked on the wire: a batch with one bad touch is refused before any of it applies.
        if self.sizes is not None and len(self.sizes) != len(self.keys):
            raise ValueError(f"touch: {len(self.sizes)} sizes for {len(self.keys)} keys")
        return self


class Refresh(_Operation):
    op: Literal["refresh"] = "refresh"
    keys: Keys


class Take(_Operation):
    op: Literal["take"] = "take"
    free_bytes: int = Field(ge=0)
    protect: Keys = Field(default_factory=list)


class Keep(_Operation):
    op: Literal["keep"] = "keep"
    taken: list[tuple[str, int]] = Field(max_length=MAX_KEYS_PER_OPERATION)


Operation = Annotated[Touch | Refresh | Take | Keep, Field(discriminator="op")]


class OperationsRequest(BaseModel):
    """The body of ``POST /v1/ops``."""

    model_config = ConfigDict(extra="forbid")
    ops: list[Operation] = Field(max_length=MAX_OPERATIONS_PER_REQUEST)


class OperationResult(BaseModel):
    """One operation's answer: `taken` for a take, `refreshed` for a refresh, else empty."""

    taken: list[tuple[str, int]] | None = None
    refreshed: int | None = None


class OperationsResponse(BaseModel):
    results: list[OperationResult]


def apply_operation(order: RecencyOrder, operation: Touch | Refresh | Take | Keep) -> OperationResult:
    """Apply one operation to the fleet's order (the caller serializes calls)."""
    if isinstance(operation, Touch):
        order.touch(operation.keys, operation.sizes, operation.shared)
        return OperationResult()
    if isinstance(operation, Refresh):
        return OperationResult(refreshed=order.refresh(operation.keys))
    if isinstance(operation, Take):
        return OperationResult(taken=order.take_oldest(operation.free_bytes, protect=operation.protect))
    order.keep(operation.taken)
    return OperationResult()
