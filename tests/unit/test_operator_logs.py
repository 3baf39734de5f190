"""The operator's log formatting (moonlease_operator.adapters.logs): which policy a line is
about, in text and JSON, whichever logger wrote it; and the flags' validation."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from moonlease.cli import build_parser
from moonlease_operator.adapters.logs import (
    LOG_FORMATS,
    LOG_LEVELS,
    JsonFormatter,
    TextFormatter,
    about_policy,
    configure_logging,
)

pytestmark = pytest.mark.unit

POLICY_REF = {"apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy", "name": "llama",
              "namespace": "team-a", "uid": "u-1"}


def record(message: str = "Stage decode verified", *, logger: str = "kopf.objects", **extra: object) -> logging.LogRecord:
    return logging.getLogger(logger).makeRecord(logger, logging.INFO, __file__, 1, message, (), None, extra=extra)


@pytest.fixture
def root_logging() -> Iterator[None]:
    """configure_logging changes the root logger: give the test run its own back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_kopf_object_lines_name_their_policy_in_text_and_json() -> None:
    line = record(k8s_ref=POLICY_REF)
    assert TextFormatter().format(line).endswith("INFO kopf.objects: [team-a/llama] Stage decode verified")
    parsed = json.loads(JsonFormatter().format(line))
    assert (parsed["namespace"], parsed["policy"], parsed["level"], parsed["message"]) == \
        ("team-a", "llama", "info", "Stage decode verified")
    assert parsed["time"].endswith("Z") and "object" not in parsed


def test_any_logger_inside_about_policy_names_the_policy_and_tasks_inherit_it() -> None:
    async def scenario() -> list[dict[str, object]]:
        lines = []
        with about_policy("team-b", "ab"):
            lines.append(json.loads(JsonFormatter().format(record("Prometheus answered", logger="moonlease_operator.x"))))

            async def child() -> None:  # a task started meanwhile (e.g. a metric read)
                lines.append(json.loads(JsonFormatter().format(record("child", logger="aiohttp.client"))))
            await asyncio.create_task(child())
        lines.append(json.loads(JsonFormatter().format(record("after", logger="moonlease_operator.x"))))
        return lines

    inside, child, after = asyncio.run(scenario())
    assert (inside["namespace"], inside["policy"]) == ("team-b", "ab")
    assert (child["namespace"], child["policy"]) == ("team-b", "ab")
    assert "policy" not in after and "namespace" not in after
    with about_policy("team-b", "ab"):
        assert TextFormatter().format(record("x", logger="moonlease_operator.x")).endswith("[team-b/ab] x")


def test_kopf_lines_about_other_objects_are_not_given_a_policy() -> None:
    pod = {"kind": "Pod", "name": "p-1", "namespace": "team-a"}
    parsed = json.loads(JsonFormatter().format(record("seen", k8s_ref=pod)))
    assert "policy" not in parsed and parsed["object"] == {"kind": "Pod", "namespace": "team-a", "name": "p-1"}
    # ...but inside a policy's task the policy is named, and the object too.
    with about_policy("team-a", "llama"):
        parsed = json.loads(JsonFormatter().format(record("seen", k8s_ref=pod)))
    assert parsed["policy"] == "llama" and parsed["object"]["name"] == "p-1"


def test_exceptions_stay_inside_one_json_line() -> None:
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError:
        line = logging.getLogger("x").makeRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = JsonFormatter().format(line)
    assert "\n" not in text and "RuntimeError: boom" in json.loads(text)["exception"]


@pytest.mark.usefixtures("root_logging")
def test_configure_logging_sets_format_and_level_and_replaces_itself() -> None:
    stream = io.StringIO()
    configure_logging("json", "warning", stream=stream)
    configure_logging("json", "warning", stream=stream)  # a second call replaces, not adds
    logging.getLogger("moonlease_operator.test").info("not shown")
    logging.getLogger("moonlease_operator.test").warning("shown")
    lines = stream.getvalue().splitlines()
    assert [json.loads(line)["message"] for line in lines] == ["shown"]
    with pytest.raises(ValueError, match="log format 'yaml'"):
        configure_logging("yaml", "info")
    with pytest.raises(ValueError, match="log level 'trace'"):
        configure_logging("text", "trace")


def test_the_cli_accepts_the_formats_and_levels_the_operator_knows_and_no_other() -> None:
    parser = build_parser()
    for log_format in LOG_FORMATS:
        for level in LOG_LEVELS:
            args = parser.parse_args(["operator", "--log-format", log_format, "--log-level", level])
            assert (args.log_format, args.log_level) == (log_format, level)
    assert (parser.parse_args(["operator"]).log_format, parser.parse_args(["operator"]).log_level) == ("text", "info")
    for wrong in (["--log-format", "yaml"], ["--log-level", "trace"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["operator", *wrong])
