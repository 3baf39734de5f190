"""Which Prometheus servers a policy may point the operator at. Pure.

The operator fetches `spec.rollout.abTest.prometheus.url` from inside the cluster, with its own
network identity: whoever can write a policy could otherwise make it request any address (an
internal service, a cloud metadata endpoint) and read the answer back from the status. The
operator's own configuration (`--prometheus-url-allow`, `MOONLEASE_PROMETHEUS_URL_ALLOWLIST`,
the chart's `operator.prometheusUrlAllowlist`) names the servers it may query; a policy naming
another is refused (`PrometheusUrlNotAllowed`) before anything is fetched.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence


def url_allowed(url: str, allowlist: Sequence[str]) -> bool:
    """Whether `url` matches an entry of `allowlist`.

    An entry is a URL: scheme and host must be equal (host case-insensitively), the port too
    when the entry names one (else any port), and the URL's path must be the entry's path or
    below it (`http://prom:9090/api` allows `/api/...`, not `/apiary`). A URL with credentials
    (`user:pass@`) never matches.
    """
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port
    except ValueError:
        return False
    if parsed.username is not None or parsed.password is not None or not parsed.hostname:
        return False
    for raw in allowlist:
        try:
            entry = urllib.parse.urlsplit(raw.strip())
            entry_port = entry.port
        except ValueError:
            continue
        if not entry.hostname or entry.scheme.lower() != parsed.scheme.lower():
            continue
        if entry.hostname.lower() != parsed.hostname.lower():
            continue
        if entry_port is not None and entry_port != port:
            continue
        prefix = entry.path.rstrip("/")
        if prefix and parsed.path.rstrip("/") != prefix and not parsed.path.startswith(prefix + "/"):
            continue
        return True
    return False


def evaluate_prometheus_url(url: str | None, allowlist: Sequence[str]) -> str | None:
    """Why a policy's Prometheus URL is refused, or None (no URL: the pods are scraped)."""
    if url is None or url_allowed(url, allowlist):
        return None
    allowed = ", ".join(allowlist) if allowlist else "none"
    return (f"prometheus.url {url} is not in the operator's allowlist (allowed: {allowed}); "
            "add it with the operator's --prometheus-url-allow (chart: operator.prometheusUrlAllowlist)")


def parse_allowlist(text: str | None) -> tuple[str, ...]:
    """`MOONLEASE_PROMETHEUS_URL_ALLOWLIST`: comma- or whitespace-separated URLs."""
    return tuple(part for part in (text or "").replace(",", " ").split() if part)
