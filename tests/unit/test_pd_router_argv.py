"""The vllm-router command line the testbed and `bench serve --engines` start (pure)."""

from __future__ import annotations

import pytest

from moonlease_dev.testbed.pd_router import router_argv

pytestmark = pytest.mark.unit


def test_every_engine_is_named_in_its_role_and_no_kv_transfer_pairing() -> None:
    argv = router_argv("vllm-router", ["http://p1", "http://p2"], ["http://d1"], port=8080,
                       metrics_port=9090, policy="random", decode_policy="round_robin")
    assert argv[0] == "vllm-router" and "--vllm-pd-disaggregation" in argv
    pairs = list(zip(argv, argv[1:]))
    assert [b for a, b in pairs if a == "--prefill"] == ["http://p1", "http://p2"]
    assert [b for a, b in pairs if a == "--decode"] == ["http://d1"]
    assert ("--port", "8080") in pairs and ("--prometheus-port", "9090") in pairs
    assert ("--policy", "random") in pairs and ("--decode-policy", "round_robin") in pairs
    assert "--kv-connector" not in argv  # the store carries the KV: no engine pairing


@pytest.mark.parametrize(("prefill", "decode", "policy", "message"), [
    ([], ["http://d"], "round_robin", "at least one prefill and one decode"),
    (["http://p"], [], "round_robin", "at least one prefill and one decode"),
    (["http://p"], ["http://d"], "fastest", "router policy 'fastest'"),
])
def test_bad_router_settings_are_refused(prefill: list[str], decode: list[str], policy: str,
                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        router_argv("vllm-router", prefill, decode, port=1, metrics_port=2, policy=policy)
