"""Retention `evict` (issue 21): the pure decisions (`core.store_room`) and the metrics parsing.

How much room a put needs, which keys leave first, what a removal's answers mean; the real
master and store are exercised by tests/connector/test_store_eviction_real_store.py, the
replay benchmark and tests/connector/test_retention_engine.py.
"""

from __future__ import annotations

import pytest

from moonlease_connector.adapters.store_eviction import StoreEviction, default_master_metrics_url, parse_master_usage
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_settings.retention import RetentionSettings
from moonlease_connector.core.store_room import (
    OBJECT_HAS_LEASE,
    RecencyOrder,
    StoreUsage,
    bytes_to_free,
    classify_removal,
)

pytestmark = pytest.mark.unit


def test_a_put_that_fits_below_the_watermark_frees_nothing() -> None:
    usage = StoreUsage(used_bytes=700, capacity_bytes=1000)
    assert bytes_to_free(usage, 100, 0.8) == 0
    assert bytes_to_free(usage, 101, 0.8) == 1
    assert bytes_to_free(usage, 300, 0.8) == 200
    assert bytes_to_free(usage, 300, 0.8, slack=0.05) == 250  # 5 % of the capacity beyond


def test_unknown_capacity_frees_nothing_and_bad_watermarks_are_refused() -> None:
    assert bytes_to_free(StoreUsage(500, 0), 10_000, 0.8) == 0
    for watermark in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError):
            bytes_to_free(StoreUsage(0, 1000), 1, watermark)
    with pytest.raises(ValueError):
        bytes_to_free(StoreUsage(0, 1000), 1, 0.8, slack=-0.1)


def test_a_prompt_touched_together_leaves_tail_first_and_oldest_prompt_first() -> None:
    order = RecencyOrder()
    order.touch(["a0", "a1", "a2"], [10, 10, 10])  # conversation a, in prompt order
    order.touch(["b0", "b1"], [10, 10])  # conversation b, later
    # a's last block is the oldest key: a leaves whole, tail first, before anything of b.
    taken = order.take_oldest(25)
    assert taken == [("a2", 10), ("a1", 10), ("a0", 10)]
    assert order.take_oldest(10) == [("b1", 10)]


def test_a_shared_prefix_touched_by_every_prompt_stays_most_recent() -> None:
    order = RecencyOrder()
    order.touch(["sys", "a1"], [10, 10])
    order.touch(["sys", "b1"], [10, 10])
    assert [key for key, _ in order.take_oldest(20)] == ["a1", "b1"]
    assert "sys" in order


def test_a_load_refreshes_the_prefix_a_save_skips_and_adopts_no_other_engines_keys() -> None:
    """A save skips the prefix its request loaded; the load is what says that prefix is in use."""
    order = RecencyOrder()
    order.touch(["a0", "a1"], [10, 10])  # conversation a's first turn
    order.touch(["b0"], [10])  # conversation b, later
    order.touch(["a2"], [10])  # a's next turn loaded a0, a1 and saved only its new block
    before = [key for key, _ in _copy(order).take_oldest(40)]
    assert before[:2] == ["a1", "a0"], "unrefreshed: a's prefix looks oldest"
    assert order.refresh(["a0", "a1", "other-engines-key"]) == 2
    assert "other-engines-key" not in order
    assert [key for key, _ in order.take_oldest(40)] == ["b0", "a2", "a1", "a0"]


def test_a_refresh_keeps_shared_marks() -> None:
    order = RecencyOrder()
    order.touch(["sys", "a1"], [10, 10], shared={"sys"})
    order.refresh(["sys", "a1"])
    assert order.is_shared("sys") and not order.is_shared("a1")
    assert order.take_oldest(100) == [("a1", 10)]


def test_evict_keeps_a_jobs_loaded_prefix_above_what_its_save_puts() -> None:
    """A conversation leaves tail first: the turn's new blocks before the prefix it loaded."""
    eviction = StoreEviction(store=None, usage=lambda: None, watermark=0.8)
    eviction.after_put(["a0", "a1"], [10, 10], [0, 0])  # conversation A saved
    eviction.after_put(["b0"], [10], [0])  # then B
    eviction.saw_load(["a0", "a1", "someone-elses"])  # A's next turn loads A (receive thread)
    eviction.saw_exist(["a2"], [0])  # its save re-checks its new block: missing
    eviction.after_put(["a2"], [10], [0])
    assert list(eviction.order._order) == ["b0", "a2", "a1", "a0"]
    eviction.saw_exist(["c0"], [0])  # the next job: the earlier load is not lifted again
    eviction.after_put(["c0"], [10], [0])
    assert list(eviction.order._order) == ["b0", "a2", "a1", "a0", "c0"]


def test_pending_loads_are_bounded_when_no_save_takes_them() -> None:
    """A decode engine loads and never saves: the loads wait for a save that never comes."""
    eviction = StoreEviction(store=None, usage=lambda: None, watermark=0.8)
    for index in range(5000):
        eviction.saw_load([f"key-{index}"])
    assert len(eviction._loads) == 1024


def _copy(order: RecencyOrder) -> RecencyOrder:
    copy = RecencyOrder(order.capacity)
    for key in order._order:
        copy._order[key] = order._order[key]
    return copy


def test_protected_keys_are_not_taken_and_keep_their_place() -> None:
    order = RecencyOrder()
    order.touch(["x", "y", "z"], [1, 1, 1])  # oldest first: z, y, x
    assert order.take_oldest(1, protect={"z"}) == [("y", 1)]
    assert order.take_oldest(1) == [("z", 1)]  # z still the oldest


def test_shared_prefix_keys_are_left_to_the_master_until_a_save_says_otherwise() -> None:
    """On a shared store other engines read a shared prefix that this order calls oldest."""
    order = RecencyOrder()
    order.touch(["sys", "a1"], [10, 10], shared={"sys"})
    order.touch(["b1"], [10], shared=frozenset())
    assert order.take_oldest(100) == [("a1", 10), ("b1", 10)]
    assert "sys" in order and order.is_shared("sys")
    order.touch(["sys"], [10])  # a read that does not know (None): the flag stays
    assert order.take_oldest(100) == []
    order.touch(["sys"], [10], shared=["other"])  # a save whose shared prefix no longer holds it
    assert order.take_oldest(100) == [("sys", 10)]


def test_a_forgotten_shared_key_leaves_no_flag_behind() -> None:
    order = RecencyOrder(capacity=3)
    order.touch(["s1", "s2", "s3", "s4"], [1] * 4, shared={"s1", "s2", "s3", "s4"})  # s4: bounded out
    order.forget(["s1"])
    order.touch(["s4"], [1], shared=None)  # back, from a read that does not know
    assert not order.is_shared("s4") and not order.is_shared("s1")
    assert order.is_shared("s2") and order.is_shared("s3")


def test_refused_keys_come_back_most_recent_and_unknown_sizes_take_the_mean() -> None:
    order = RecencyOrder()
    order.touch(["p", "q"], [100, 300])
    taken = order.take_oldest(1)
    assert taken == [("q", 300)]
    order.keep(taken)  # leased: in use
    assert order.take_oldest(1) == [("p", 100)]
    order.touch(["new"])  # found in the store, never put here: the mean of known sizes
    assert order.size_of("new") == 300
    order.touch(["q"], [None])  # a size of None keeps the known one
    assert order.size_of("q") == 300


def test_the_order_is_bounded() -> None:
    order = RecencyOrder(capacity=3)
    order.touch(["k1", "k2", "k3", "k4", "k5"], [1] * 5)
    assert len(order) == 3
    assert "k5" not in order and "k4" not in order  # the oldest (the prompt's tail) forgotten
    with pytest.raises(ValueError):
        RecencyOrder(capacity=0)


def test_removal_answers_removed_leased_or_gone() -> None:
    outcome = classify_removal([("a", 10), ("b", 20), ("c", 30)], [0, OBJECT_HAS_LEASE, -704])
    assert outcome.removed == ("a",)
    assert outcome.kept == (("b", 20),)
    assert outcome.gone == ("c",)
    assert outcome.freed_bytes == 10


def test_master_metrics_text_gives_usage() -> None:
    text = ("# HELP master_allocated_bytes x\n# TYPE master_allocated_bytes gauge\n"
            "master_allocated_bytes 1234\nmaster_total_capacity_bytes 16777216\n"
            "master_key_count 3\n")
    assert parse_master_usage(text) == StoreUsage(1234.0, 16777216.0)
    labelled = 'master_allocated_bytes{segment="a"} 10\nmaster_allocated_bytes{segment="b"} 5\n' \
               'master_total_capacity_bytes{segment="a"} 100\n'
    assert parse_master_usage(labelled) == StoreUsage(15.0, 100.0)
    assert parse_master_usage("master_key_count 3\n") is None


def test_default_metrics_url_comes_from_the_engines_mooncake_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "mooncake.json"
    config.write_text('{"master_server_address": "master.ns.svc:50051"}')
    assert default_master_metrics_url({"MOONCAKE_CONFIG_PATH": str(config)}) == \
        "http://master.ns.svc:9003/metrics"
    assert default_master_metrics_url({}) is None
    assert default_master_metrics_url({"MOONCAKE_CONFIG_PATH": str(tmp_path / "missing.json")}) is None


def test_evict_is_a_connector_setting_rendered_only_when_on() -> None:
    off = MoonleaseConnectorConfig.for_mode(LeaseMode.LEASE_ALL, junction_retention=True)
    assert "mooncake_retention_evict" not in off.model_fields_set
    on = MoonleaseConnectorConfig.for_mode(LeaseMode.LEASE_ALL, junction_retention=True,
                                           retention=RetentionSettings(evict=True, evict_watermark=0.8))
    assert on.mooncake_retention_evict is True
    assert on.mooncake_retention_evict_watermark == 0.8
    assert {"mooncake_retention_evict", "mooncake_retention_evict_watermark"} <= on.model_fields_set
    assert on.retention == RetentionSettings(evict=True, evict_watermark=0.8)
    assert on.retention.active and not on.retention.plans_saves
    parsed = MoonleaseConnectorConfig.from_sources({"mooncake_retention_evict": True,
                                                    "mooncake_retention_evict_watermark": 0.85,
                                                    "mooncake_master_metrics_url": "http://m:9003/metrics"})
    assert parsed.retention.evict and parsed.retention.evict_watermark == 0.85
    with pytest.raises(ValueError):
        MoonleaseConnectorConfig.from_sources({"mooncake_retention_evict_watermark": 1.5})
    with pytest.raises(ValueError):
        RetentionSettings(evict=True, evict_watermark=0.0)
