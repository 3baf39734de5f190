"""The operator's JSON logs on a real run (kopf against the local API server): one object per
line, and every line about the policy names it — kopf's own lines about it, the reconciles'
and the release on deletion."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from moonlease_dev.testbed.kube import LocalApiServer
from moonlease_operator.adapters.logs import configure_logging
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import NS, create_fleet, phase, policy

pytestmark = pytest.mark.operator
WAIT = 15.0


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The process' logging as `moonlease operator --log-format json` sets it, into a buffer."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    yield stream
    root.handlers[:] = handlers
    root.setLevel(level)


async def test_every_line_about_a_policy_names_it(kube: LocalApiServer, json_log: io.StringIO) -> None:
    await create_fleet(kube)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="phase Ready")
        await kube.delete("mlp", NS, "fleet")
        await kube.wait_for(lambda: kube.get("mlp", NS, "fleet") is None, timeout=WAIT, what="the policy gone")
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]  # each line is one object
    assert lines and all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    about = [line for line in lines if line.get("policy") == "fleet"]
    assert about and all(line["namespace"] == NS for line in about)
    # kopf's lines about an object are all about this policy here: each names it.
    from_kopf = [line for line in lines if line["logger"] == "kopf.objects"]
    assert from_kopf and all(line.get("policy") == "fleet" for line in from_kopf), from_kopf
    # The release on deletion logs through kopf's object logger inside about_policy.
    assert any(line["message"].startswith("Released") and line.get("policy") == "fleet" for line in lines), \
        [line["message"] for line in about]
    # No line mentions the policy without naming it in the fields.
    assert all(line.get("policy") == "fleet" for line in lines if f"{NS}/fleet" in line["message"])
