"""Moonlease operator: rolls MooncakeLeasePolicy changes out to a Mooncake master and vLLM fleet.

Layers: `api` (pydantic models, the CRD's source of truth) and `core` (decisions) are pure;
`adapters` talk to Kubernetes; `handlers` are the thin kopf entry points; `runner` starts kopf.
"""
