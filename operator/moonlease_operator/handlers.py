"""The kopf entry points. Thin: parse, ask the core, write the answer through kopf.

`register(registry)` attaches them to a registry (the runner builds one per operator, so two
operators in one process, such as tests, do not share handlers). The foundation handles one
thing: whether a MooncakeLeasePolicy's spec is accepted; rolling out to workloads comes later.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import kopf

from moonlease_operator.api import GROUP, PLURAL, VERSION, Reason
from moonlease_operator.core.acceptance import dump_status, plan_acceptance, read_status

Clock = Callable[[], datetime.datetime]


def utc_now() -> datetime.datetime:
    """Seconds precision: Kubernetes timestamps have no fractions."""
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def register(registry: kopf.OperatorRegistry, *, clock: Clock = utc_now) -> None:
    """Attach the MooncakeLeasePolicy handlers to `registry`; `clock` stamps the conditions."""

    async def accept_policy(
        spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, body: kopf.Body, patch: kopf.Patch,
        logger: kopf.Logger, **_: Any,
    ) -> None:
        """Judge the spec and report the verdict in the status (and an event if refused)."""
        plan = plan_acceptance(spec, generation=meta.get("generation"), previous=read_status(status),
                               now=clock())
        patch["status"] = dump_status(plan.status)
        if plan.warning is not None:
            kopf.warn(body, reason=Reason.INVALID_SPEC.value, message=plan.warning)
        if plan.accepted:
            logger.info("Policy accepted (generation %s).", meta.get("generation"))
        else:
            logger.info("Policy refused: %s", "; ".join(plan.problems))

    resource = (GROUP, VERSION, PLURAL)
    kopf.on.resume(*resource, id="accept_policy", registry=registry)(accept_policy)
    kopf.on.create(*resource, id="accept_policy", registry=registry)(accept_policy)
    kopf.on.update(*resource, id="accept_policy", field="spec", registry=registry)(accept_policy)
