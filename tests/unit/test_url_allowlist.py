"""The operator reads only the Prometheus servers its own configuration allows (issue 17)."""

from __future__ import annotations

import pytest

from moonlease_operator.core.url_allowlist import evaluate_prometheus_url, parse_allowlist, url_allowed

pytestmark = pytest.mark.unit

ALLOW = ("http://prometheus-operated.monitoring:9090", "https://thanos.example.com/api/", "http://127.0.0.1")


@pytest.mark.parametrize("url, allowed", [
    ("http://prometheus-operated.monitoring:9090", True),
    ("http://PROMETHEUS-operated.monitoring:9090/", True),
    ("http://prometheus-operated.monitoring:9091", False),       # another port
    ("https://prometheus-operated.monitoring:9090", False),      # another scheme
    ("http://prometheus-operated.monitoring.evil.com:9090", False),
    ("https://thanos.example.com/api", True),
    ("https://thanos.example.com/api/v1", True),
    ("https://thanos.example.com/apiary", False),                # a path prefix is a whole segment
    ("https://thanos.example.com/", False),
    ("http://127.0.0.1:41234", True),                            # no port in the entry: any port
    ("http://user:pw@127.0.0.1:9090", False),                    # credentials never match
    ("http://169.254.169.254/latest/meta-data", False),
    ("http://[::1", False),                                      # unparseable
])
def test_urls_match_the_allowlist_by_scheme_host_port_and_path(url: str, allowed: bool) -> None:
    assert url_allowed(url, ALLOW) is allowed


def test_an_empty_allowlist_allows_nothing_and_says_how_to_allow() -> None:
    problem = evaluate_prometheus_url("http://prom:9090", ())
    assert problem is not None and "allowed: none" in problem and "--prometheus-url-allow" in problem
    assert evaluate_prometheus_url(None, ()) is None  # scraping the pods needs no allowlist


def test_the_environment_form_is_comma_or_space_separated() -> None:
    assert parse_allowlist(" http://a:1, http://b:2 http://c ") == ("http://a:1", "http://b:2", "http://c")
    assert parse_allowlist(None) == ()
