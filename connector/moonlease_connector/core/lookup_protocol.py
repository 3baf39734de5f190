"""The lookup response on the scheduler <-> worker channel, with junction entries. Pure.

Upstream's format (vLLM ``mooncake/store/protocol.py``): the hit length as a big-endian u32,
then zero or more 8-byte entries, each a group id (u32) and a token boundary (u32) — the tail
keys of the hit, one per KV-cache group.

Junctions (seed 004) travel as extra 8-byte entries whose group id is the sentinel
`JUNCTION_GROUP_ID`, after the tail entries. Both directions stay compatible:
- an old reader decodes them as tail entries of a group that does not exist; every consumer
  upstream looks tail entries up by a real group id (the receive thread builds
  ``{group_id: num_tokens}`` and asks for each of its groups; the scheduler passes the tuple
  through untouched), so they are ignored;
- a new reader accepts a payload from a writer that predates junctions: no sentinel entries,
  no junctions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from moonlease_connector.core.lookup import TailKey

#: Group id marking a junction entry. vLLM numbers KV-cache groups from 0, densely; no model
#: has 2**32 - 1 of them.
JUNCTION_GROUP_ID = 0xFFFF_FFFF
ENTRY_SIZE = 8
_U32_MAX = 0xFFFF_FFFF


class LookupResponseError(ValueError):
    """A lookup response that cannot be encoded or decoded (the caller reports a miss)."""


@dataclass(frozen=True)
class LookupResponse:
    """What a lookup answers: the hit, its tail keys, and shared-prefix junctions (tokens)."""

    hit_length: int
    tails: tuple[TailKey, ...] = ()
    junctions: tuple[int, ...] = ()


def build_wire_entries(response: LookupResponse) -> tuple[tuple[int, int], ...]:
    """The `(group_id, num_tokens)` entries after the hit: tails, then junction entries."""
    entries = [(tail.group_id, tail.num_tokens) for tail in response.tails]
    if any(group_id == JUNCTION_GROUP_ID for group_id, _ in entries):
        raise LookupResponseError(f"group id {JUNCTION_GROUP_ID:#x} is reserved for junctions")
    entries.extend((JUNCTION_GROUP_ID, junction) for junction in response.junctions)
    for value in (response.hit_length, *(v for entry in entries for v in entry)):
        if not 0 <= value <= _U32_MAX:
            raise LookupResponseError(f"{value} does not fit the lookup response's u32 fields")
    return tuple(entries)


def parse_wire_entries(hit_length: int, entries: Iterable[tuple[int, int]]) -> LookupResponse:
    """Split entries into tail keys and junctions (the inverse of `build_wire_entries`)."""
    tails: list[TailKey] = []
    junctions: list[int] = []
    for group_id, num_tokens in entries:
        if group_id == JUNCTION_GROUP_ID:
            junctions.append(num_tokens)
        else:
            tails.append(TailKey(group_id, num_tokens))
    return LookupResponse(hit_length, tuple(tails), tuple(junctions))


def encode_lookup_response(response: LookupResponse) -> bytes:
    """Upstream's byte layout, junction entries included (a no-junction response is upstream's)."""
    entries = build_wire_entries(response)  # validates every field first
    payload = bytearray(response.hit_length.to_bytes(4, "big"))
    for group_id, num_tokens in entries:
        payload += group_id.to_bytes(4, "big") + num_tokens.to_bytes(4, "big")
    return bytes(payload)


def decode_lookup_response(payload: bytes | bytearray | memoryview) -> LookupResponse:
    """Read a response from either writer: with junction entries, or from before them."""
    data = bytes(payload)
    if len(data) < 4 or (len(data) - 4) % ENTRY_SIZE:
        raise LookupResponseError(f"invalid lookup response of {len(data)} bytes")
    hit_length = int.from_bytes(data[:4], "big")
    entries = [(int.from_bytes(data[offset:offset + 4], "big"),
                int.from_bytes(data[offset + 4:offset + 8], "big"))
               for offset in range(4, len(data), ENTRY_SIZE)]
    return parse_wire_entries(hit_length, entries)
