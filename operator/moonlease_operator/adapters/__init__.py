"""Kubernetes I/O for the operator (`fetch_*`, `apply_*`, `ensure_*`): reading and patching
workloads and pods. Empty in the foundation: its only write is the policy's own status, which
kopf applies from the handler's patch."""
