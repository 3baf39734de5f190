"""Kubernetes I/O for the operator (`fetch_*`, `apply_*`, `post_*`): `kube` (a small API client
logged in as kopf is), `workloads` (reading the fleet, writing the planner's changes, status and
events), `metrics` (the operator's Prometheus metrics)."""
