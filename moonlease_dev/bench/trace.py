"""The replay trace: a JSONL file of prompt arrivals. Pure (plus `read_trace`/`write_trace`).

Line 1 is a `TraceHeader`; every further line is one `TraceRequest`, in arrival order:

    {"type": "header", "format": "moonlease-trace/1", "workload": "agentic-swa",
     "layout": "full+swa", "retention": "sparse", "hash_block_tokens": 16, "seed": 7, "knobs": {...}}
    {"type": "request", "arrival_s": 12.5, "session": "s3", "kind": "turn",
     "block_hashes": ["9f0c...", ...], "output_tokens": 128}

`block_hashes` are the prompt's hash-block hashes, one per full `hash_block_tokens` block,
chained as vLLM's are (two prompts share a prefix exactly when they share its hashes). Each
KV-cache group's own chunk hashes — per group, at that group's block size (a Mamba checkpoint
every 4 blocks, ...) — are derived from them by vLLM's coordinator (`block_hashes_for_spec`),
as in an engine, so one list serves every group of the header's `layout`. Prompts are
block-aligned (`prompt_tokens = len(block_hashes) * hash_block_tokens`). `output_tokens` is the
answer's length: the generator makes it part of the session's next prompt; the replay stores no
decode KV (upstream's default, `save_decode_cache` off). A `.gz` suffix compresses the file.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

TRACE_FORMAT = "moonlease-trace/1"
RETENTIONS = ("dense", "sparse")


class TraceError(ValueError):
    """A trace line that does not follow the format (the message names the line)."""


@dataclass(frozen=True)
class TraceHeader:
    """What the trace was made for: the model layout, store retention and generator knobs.

    `retention` is vLLM's `prefix_cache_retention_interval` as the store masks read it:
    "dense" stores a sliding-window tail / Mamba state at every block boundary, "sparse"
    (vLLM's default, 0) only at each prompt's replay boundary.
    """

    workload: str
    layout: str
    retention: str = "sparse"
    hash_block_tokens: int = 16
    seed: int = 0
    knobs: dict[str, Any] = field(default_factory=dict)
    format: str = TRACE_FORMAT

    def __post_init__(self) -> None:
        if self.format != TRACE_FORMAT:
            raise TraceError(f"unknown trace format {self.format!r}; this reader knows {TRACE_FORMAT}")
        if self.retention not in RETENTIONS:
            raise TraceError(f"retention {self.retention!r}: use one of {', '.join(RETENTIONS)}")
        if self.hash_block_tokens <= 0:
            raise TraceError("hash_block_tokens must be positive")


@dataclass(frozen=True)
class TraceRequest:
    """One prompt arriving at `arrival_s` (virtual seconds from the trace's start)."""

    arrival_s: float
    session: str
    block_hashes: tuple[str, ...]
    output_tokens: int = 0
    kind: str = "turn"  # new | turn | resume | branch | long: what the generator drew

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise TraceError(f"arrival_s {self.arrival_s} is negative")
        if self.output_tokens < 0:
            raise TraceError(f"output_tokens {self.output_tokens} is negative")
        if not self.block_hashes:
            raise TraceError(f"request of session {self.session!r} has no block hashes")

    def hashes(self) -> list[bytes]:
        return [bytes.fromhex(h) for h in self.block_hashes]

    def prompt_tokens(self, hash_block_tokens: int) -> int:
        return len(self.block_hashes) * hash_block_tokens


@dataclass(frozen=True)
class Trace:
    header: TraceHeader
    requests: tuple[TraceRequest, ...]

    def __post_init__(self) -> None:
        for before, after in zip(self.requests, self.requests[1:]):
            if after.arrival_s < before.arrival_s:
                raise TraceError(f"requests out of arrival order at {after.arrival_s} s")

    @property
    def span_s(self) -> float:
        """Virtual seconds from the first arrival to the last."""
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0


def build_lines(trace: Trace) -> list[str]:
    """The trace as JSONL lines (header first)."""
    lines = [json.dumps({"type": "header", **asdict(trace.header)}, sort_keys=True)]
    for request in trace.requests:
        record = asdict(request)
        record["block_hashes"] = list(request.block_hashes)
        lines.append(json.dumps({"type": "request", **record}, sort_keys=True))
    return lines


def parse_lines(lines: Iterable[str]) -> Trace:
    """Inverse of `build_lines`; blank lines are skipped, anything else malformed raises."""
    header: TraceHeader | None = None
    requests: list[TraceRequest] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            kind = record.pop("type")
            if kind == "header" and header is None and number == 1:
                header = TraceHeader(**record)
            elif kind == "request" and header is not None:
                record["block_hashes"] = tuple(record["block_hashes"])
                requests.append(TraceRequest(**record))
            else:
                raise TraceError(f"unexpected {kind!r} record (a header must come first, once)")
        except (TraceError, TypeError, KeyError, json.JSONDecodeError) as error:
            raise TraceError(f"line {number}: {error}") from None
    if header is None:
        raise TraceError("empty trace: no header line")
    return Trace(header, tuple(requests))


def _open(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")  # type: ignore[return-value]
    return path.open(mode, encoding="utf-8")


def write_trace(trace: Trace, path: Path) -> None:
    with _open(path, "w") as out:
        for line in build_lines(trace):
            out.write(line + "\n")


def read_trace(path: Path) -> Trace:
    with _open(path, "r") as source:
        return parse_lines(source)

