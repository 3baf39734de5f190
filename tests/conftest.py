"""Test bed of real parts. Each fixture module wraps one `moonlease.testbed` component.

Tiers are pytest markers (see pyproject.toml); every test gets its tier from the folder or
module it lives in, and `make test` runs them all. Nothing is skipped for a missing dependency:
`make setup` installs every real part, and a missing one fails loudly.
"""

from hypothesis import settings

from moonlease import devenv

# Property tests assert behaviour, never speed: no per-example deadline (the suite runs on a
# shared 2-core machine, where one example can take a second under load).
settings.register_profile("moonlease", deadline=None)
settings.load_profile("moonlease")

# Mooncake 0.3.14 (CUDA 13 wheel) needs the CPU libcuda stub on this machine: load it before
# anything imports mooncake, and export the library path for the servers tests start.
devenv.preload()

pytest_plugins = [
    "tests.fixtures.mooncake",
    "tests.fixtures.kube",
    "tests.fixtures.vllm",
    "tests.fixtures.prometheus",
]

TIERS = ("unit", "store", "vllm", "operator", "chart", "prometheus", "images", "conformance")


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Every test belongs to a tier, so `-m <tier>` selections never silently miss one."""
    untiered = [item.nodeid for item in items
                if not any(item.get_closest_marker(tier) for tier in TIERS)]
    if untiered:
        raise ValueError("tests without a tier marker (" + ", ".join(TIERS) + "): "
                         + ", ".join(untiered[:10]))
