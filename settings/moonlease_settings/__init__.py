"""The connector's settings contract, shared by the connector, the operator and the command line.

What the connector reads and the operator writes must be decided once, so both import it from
here: the connector's typed configuration (`config`: the `mooncake_*` keys of
`kv_connector_extra_config`), the live settings file and its hash (`settings_file`), the lease
modes with each mode's facts (`lease_modes`) and the retention settings (`retention`).

Pure (pydantic and the standard library): no vLLM, torch, Mooncake or Kubernetes client, so the
operator's image holds it without the connector, and the connector's image without the operator.
"""
