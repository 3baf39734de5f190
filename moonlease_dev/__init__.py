"""Moonlease's development tooling: the test bed (local Kubernetes API server, real
Mooncake and vLLM processes), the benchmarks, the demo and the development environment.
Not part of the product distribution `moonlease`; installed from this repository by
`make setup` (dev/pyproject.toml)."""
