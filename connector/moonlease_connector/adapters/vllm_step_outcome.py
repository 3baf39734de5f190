"""Did the current model step raise? Told from the step's own exception, not any in flight.

vLLM runs a step's KV-connector work in a context manager around the forward pass
(`KVConnectorModelRunnerMixin._get_kv_connector_output`): `bind_connector_metadata` before
the forward, then `wait_for_save` and `build_connector_worker_meta` from its `finally`. A
`finally` is not told whether its body raised, and the exception in flight there may belong
to someone else: a step run while an unrelated exception is being handled (an `except` block
around the engine, a retry loop) sees that exception too. So the watch remembers what was in
flight when the step began and counts as the step's failure only an exception that was not.
"""

from __future__ import annotations

import sys


class StepOutcomeWatch:
    """One per worker; `begin` at `bind_connector_metadata`, `failure` in the step's `finally`."""

    def __init__(self) -> None:
        self._in_flight_at_begin: BaseException | None = None

    def begin(self) -> None:
        self._in_flight_at_begin = sys.exc_info()[1]

    def failure(self) -> BaseException | None:
        """The exception this step raised, or None when it ran to completion."""
        in_flight = sys.exc_info()[1]
        if in_flight is None or in_flight is self._in_flight_at_begin:
            return None
        return in_flight
