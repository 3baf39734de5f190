"""The operator's decisions, as pure functions over the `api` models (no kopf, no Kubernetes)."""
