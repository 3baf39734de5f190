"""The operator's log lines: plain text (the default) or one JSON object per line, and the level.

Every line about a policy names it. kopf's per-object logger (the `logger` its handlers get)
carries the object's reference; lines from anywhere else (our adapters, the A/B metric reads,
kopf's own messages) logged while a handler or daemon works on a policy get it from a context
variable that `about_policy` sets for that task (asyncio tasks inherit it). Text lines start
with `[namespace/name]`; JSON lines carry `namespace` and `policy`.

Not pure: it configures the process' root logger (`configure_logging`).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from moonlease_operator.api import KIND

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: The policy (namespace, name) the current task works on, if any.
_POLICY: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("moonlease_policy", default=None)


@contextlib.contextmanager
def about_policy(namespace: str, name: str) -> Iterator[None]:
    """Name the policy on every line logged by this task (and tasks it starts) until exit."""
    token = _POLICY.set((namespace, name))
    try:
        yield
    finally:
        _POLICY.reset(token)


def policy_of(record: logging.LogRecord) -> tuple[str, str] | None:
    """The policy a record is about: kopf's object reference when it is a policy, else the task's."""
    ref = getattr(record, "k8s_ref", None)
    if isinstance(ref, dict) and ref.get("kind") == KIND and ref.get("name"):
        return str(ref.get("namespace") or ""), str(ref["name"])
    return _POLICY.get()


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT`, the message prefixed with `[namespace/name]` of its policy."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        policy = policy_of(record)
        if policy is None:
            return super().formatMessage(record)
        prefixed = logging.makeLogRecord(record.__dict__)
        prefixed.message = f"[{policy[0]}/{policy[1]}] {record.message}"
        return super().formatMessage(prefixed)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, RFC 3339), level, logger, message; `namespace` and
    `policy` when the line is about one; `object` (kind/namespace/name) for another object kopf
    logs about; `exception` with the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        policy = policy_of(record)
        if policy is not None:
            line["namespace"], line["policy"] = policy
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict) and ref.get("kind") != KIND:
            line["object"] = {k: ref.get(k) for k in ("kind", "namespace", "name") if ref.get(k)}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class _OurHandler(logging.StreamHandler[TextIO]):
    """Marks the handler `configure_logging` installed, so a second call replaces it."""


def configure_logging(log_format: str = "text", log_level: str = "info", *, stream: TextIO | None = None) -> None:
    """Send every logger's lines (the operator's, kopf's, the Kubernetes client's) to `stream`
    (stderr) in `log_format` at `log_level` and above. Raises ValueError for anything else."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: choose one of {', '.join(LOG_FORMATS)}")
    if log_level not in LOG_LEVELS:
        raise ValueError(f"log level {log_level!r}: choose one of {', '.join(LOG_LEVELS)}")
    handler = _OurHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, _OurHandler)] + [handler]
    root.setLevel(log_level.upper())
    # asyncio's debug chatter only at debug (as kopf's own configure does).
    logging.getLogger("asyncio").setLevel(logging.DEBUG if log_level == "debug" else logging.WARNING)
