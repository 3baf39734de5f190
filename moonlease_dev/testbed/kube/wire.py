"""Protocol Buffers wire format, written: the bytes of one field of a message.

A message is the concatenation of its fields, each a key (field number and wire type, a varint)
and a value. Used by `openapi_protobuf` to answer clients that ask for the OpenAPI document as
protobuf; `protobuf` reads request bodies with its own decoder. Pure.

Scalars follow proto3: a field with no explicit presence is not written when it holds its zero
value (`implicit` fields); fields of a `oneof` are written whatever their value (`field_*` with
`always=True`), as Go's `proto.Marshal` does.
"""

from __future__ import annotations

import struct

#: Wire types (the low three bits of a key).
VARINT, FIXED64, LENGTH_DELIMITED = 0, 1, 2


def varint(value: int) -> bytes:
    """Base-128, least significant group first; a negative int64 as its 64-bit two's complement
    (ten bytes), as protobuf encodes `int64` and `int32`."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def field_bytes(number: int, data: bytes) -> bytes:
    """A length-delimited field: a string's UTF-8, `bytes`, or an embedded message (written even
    when empty: a present message is not an absent one)."""
    return key(number, LENGTH_DELIMITED) + varint(len(data)) + data


def field_string(number: int, value: str, *, always: bool = False) -> bytes:
    return field_bytes(number, value.encode()) if value or always else b""


def field_int(number: int, value: int, *, always: bool = False) -> bytes:
    """An `int64`/`int32` field."""
    return key(number, VARINT) + varint(value) if value or always else b""


def field_bool(number: int, value: bool, *, always: bool = False) -> bytes:
    return key(number, VARINT) + (b"\x01" if value else b"\x00") if value or always else b""


def field_double(number: int, value: float, *, always: bool = False) -> bytes:
    """A `double` field: eight bytes, little-endian IEEE 754."""
    return key(number, FIXED64) + struct.pack("<d", float(value)) if value or always else b""
