"""Test bed of real parts. Each fixture module wraps one `moonlease_dev.testbed` component.

Tiers are pytest markers (see pyproject.toml); every test gets its tier from the folder or
module it lives in, and `make test` runs them all. Nothing is skipped for a missing dependency:
`make setup` installs every real part, and a missing one fails loudly.
"""

import pytest
from hypothesis import settings

from moonlease_dev import devenv

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
    "tests.support.xdist_groups",
]

TIERS = ("unit", "slow", "compat", "store", "vllm", "operator", "chart", "prometheus", "images", "conformance")


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """Every test belongs to a tier, so `-m <tier>` selections never silently miss one."""
    untiered = [item.nodeid for item in items
                if not any(item.get_closest_marker(tier) for tier in TIERS)]
    if untiered:
        raise ValueError("tests without a tier marker (" + ", ".join(TIERS) + "): "
                         + ", ".join(untiered[:10]))


#: A test with several tier markers is timed under the heaviest real part it starts.
_TIMING_ORDER = ("images", "vllm", "operator", "conformance", "prometheus", "chart", "store", "compat", "slow", "unit")
_tier_seconds: dict[str, float] = {}
_tier_tests: dict[str, int] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Each report names its test's timing tier: an xdist worker sends the report's attributes
    along to the process that prints the summary, which has no items of its own."""
    report = yield
    report.moonlease_tier = next((tier for tier in _TIMING_ORDER if item.get_closest_marker(tier)), "unit")
    return report


def pytest_runtest_logreport(report):  # type: ignore[no-untyped-def]
    """Wall time per tier (set-up, call and tear-down), so the docs' tier times come from runs.
    Under `-n 2` the sums are test time on both workers together, more than the run's wall time."""
    tier = getattr(report, "moonlease_tier", None)
    if tier is None:
        return
    _tier_seconds[tier] = _tier_seconds.get(tier, 0.0) + report.duration
    if report.when == "call":
        _tier_tests[tier] = _tier_tests.get(tier, 0) + 1


def pytest_terminal_summary(terminalreporter):  # type: ignore[no-untyped-def]
    if not _tier_seconds:
        return
    terminalreporter.section("time per tier (each test under its heaviest tier)")
    for tier in _TIMING_ORDER:
        if tier in _tier_seconds:
            seconds = _tier_seconds[tier]
            terminalreporter.write_line(
                f"{tier:>10}: {_tier_tests.get(tier, 0):5d} tests {seconds / 60:6.1f} min")
