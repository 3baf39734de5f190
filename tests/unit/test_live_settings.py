"""Live connector settings: the file format, the hash both sides compute, the switch decision,
and the watcher + exporter on a ConfigMap-shaped directory (real files, a real HTTP endpoint on
loopback; no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moonlease_connector.adapters.settings_watcher import LiveSettings, SettingsExporter, SettingsWatcher
from moonlease_settings.config import ConnectorConfigError, LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities
from moonlease_connector.core.live_settings import (
    ActiveSettings,
    RefusalReason,
    SettingsSource,
    decide_switch,
)
from moonlease_settings.settings_file import (
    SettingsDelivery,
    delivery_from_sources,
    parse_settings_file,
    render_settings_file,
    settings_hash,
)
from tests.support.settings_volume import ConfigMapVolume, scrape

pytestmark = pytest.mark.unit

NEW_CLIENT = StoreCapabilities("0.3.14", True, ("none", "LastHitOnly"))
OLD_CLIENT = StoreCapabilities("0.3.13.post1", False, ())
DEFAULTS = MoonleaseConnectorConfig()
STARTUP = ActiveSettings(DEFAULTS, SettingsSource.STARTUP)


def hybrid(mode: LeaseMode) -> str | None:
    return None


def not_hybrid(mode: LeaseMode) -> str | None:
    return "the model has no recurrent (Mamba) group" if mode is LeaseMode.LAST_HIT_ONLY else None


def test_hash_is_stable_and_sensitive_to_every_setting() -> None:
    base = settings_hash(DEFAULTS)
    assert base == settings_hash(MoonleaseConnectorConfig(**DEFAULTS.model_dump()))
    assert len(base) == 16 and int(base, 16) >= 0
    variants = {settings_hash(MoonleaseConnectorConfig(mooncake_lease_mode=LeaseMode.SELECTIVE)),
                settings_hash(MoonleaseConnectorConfig(mooncake_lease_mode=LeaseMode.LAST_HIT_ONLY)),
                settings_hash(MoonleaseConnectorConfig(mooncake_junction_retention=True)),
                settings_hash(MoonleaseConnectorConfig(mooncake_max_lease_rounds=4))}
    assert len(variants) == 4 and base not in variants


def test_a_setting_added_later_at_its_default_leaves_the_hash_unchanged() -> None:
    """Version skew: the operator's model may know a setting the running connector's does not."""

    class NextReleaseConfig(MoonleaseConnectorConfig):
        mooncake_setting_of_a_later_release: bool = False

    for config in (DEFAULTS, MoonleaseConnectorConfig(mooncake_lease_mode=LeaseMode.SELECTIVE, mooncake_max_lease_rounds=4)):
        later = NextReleaseConfig(**config.model_dump())
        assert settings_hash(later) == settings_hash(config)
        assert settings_hash(later.model_copy(update={"mooncake_setting_of_a_later_release": True})) \
            != settings_hash(config)


def test_rendered_file_parses_back_to_the_same_settings_whatever_the_defaults() -> None:
    wanted = MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE, junction_retention=True)
    text = render_settings_file(wanted)
    odd_defaults = MoonleaseConnectorConfig(mooncake_lease_mode=LeaseMode.LAST_HIT_ONLY, mooncake_max_lease_rounds=7)
    assert parse_settings_file(text, DEFAULTS) == wanted
    assert parse_settings_file(text, odd_defaults) == wanted
    assert settings_hash(parse_settings_file(text, odd_defaults)) == settings_hash(wanted)


def test_keys_the_file_leaves_out_keep_their_startup_default() -> None:
    defaults = MoonleaseConnectorConfig(mooncake_max_lease_rounds=5)
    parsed = parse_settings_file('{"mooncake_lease_mode": "selective"}', defaults)
    assert parsed.lease_mode is LeaseMode.SELECTIVE and parsed.mooncake_max_lease_rounds == 5


@pytest.mark.parametrize(("text", "needle"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"mooncake_lease_mood": "selective"}', "did you mean 'mooncake_lease_mode'"),
    ('{"mooncake_lease_mode": true}', "True is not a lease mode"),
    ('{"mooncake_lease_mode": "selective", "mooncake_kda_last_hit_only": true}', "contradicts"),
    ('{"mooncake_max_lease_rounds": 0}', "mooncake_max_lease_rounds"),
])
def test_bad_files_are_refused_with_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ConnectorConfigError, match=needle):
        parse_settings_file(text, DEFAULTS)
    decision = decide_switch(STARTUP, text, defaults=DEFAULTS, capabilities=NEW_CLIENT,
                             layout_problem=hybrid)
    assert decision.refusal is RefusalReason.INVALID and decision.active is STARTUP
    assert needle.split("'")[0] in decision.message and "keeping lease mode leaseAll" in decision.message


def test_a_servable_change_switches() -> None:
    text = render_settings_file(MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE))
    decision = decide_switch(STARTUP, text, defaults=DEFAULTS, capabilities=NEW_CLIENT,
                             layout_problem=hybrid)
    assert decision.switched and decision.refusal is None
    assert decision.active.config.lease_mode is LeaseMode.SELECTIVE
    assert decision.active.source is SettingsSource.FILE
    assert decision.active.hash in decision.message and STARTUP.hash in decision.message


def test_same_settings_from_the_file_change_only_the_source() -> None:
    decision = decide_switch(STARTUP, render_settings_file(DEFAULTS), defaults=DEFAULTS,
                             capabilities=NEW_CLIENT, layout_problem=hybrid)
    assert not decision.switched and decision.refusal is None
    assert decision.active.config == DEFAULTS and decision.active.source is SettingsSource.FILE


def test_a_mode_the_client_lacks_is_refused_naming_the_requirement() -> None:
    wanted = MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE)
    decision = decide_switch(STARTUP, render_settings_file(wanted), defaults=DEFAULTS,
                             capabilities=OLD_CLIENT, layout_problem=hybrid)
    assert decision.refusal is RefusalReason.CLIENT_UNSUPPORTED and decision.active is STARTUP
    assert decision.refused_hash == settings_hash(wanted)
    assert "Mooncake >= 0.3.14" in decision.message


def test_last_hit_only_on_a_model_without_recurrent_state_is_refused() -> None:
    wanted = MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY)
    decision = decide_switch(STARTUP, render_settings_file(wanted), defaults=DEFAULTS,
                             capabilities=NEW_CLIENT, layout_problem=not_hybrid)
    assert decision.refusal is RefusalReason.MODEL_UNSUPPORTED and decision.active is STARTUP
    assert "no recurrent (Mamba) group" in decision.message


def test_junction_retention_alone_needs_no_capability() -> None:
    wanted = MoonleaseConnectorConfig(mooncake_junction_retention=True)
    decision = decide_switch(STARTUP, render_settings_file(wanted), defaults=DEFAULTS,
                             capabilities=OLD_CLIENT, layout_problem=not_hybrid)
    assert decision.switched and decision.active.config == wanted


def test_delivery_keys_and_environment() -> None:
    assert delivery_from_sources({}, {}) == SettingsDelivery(None, None)
    assert delivery_from_sources({"mooncake_settings_file": "/s.json"}, {}) == SettingsDelivery("/s.json", 9410)
    assert delivery_from_sources({}, {"MOONLEASE_SETTINGS_FILE": "/e.json",
                                      "MOONLEASE_SETTINGS_METRICS_PORT": "9500"}) == SettingsDelivery("/e.json", 9500)
    assert delivery_from_sources({"mooncake_settings_file": "/x", "mooncake_settings_metrics_port": 0},
                                 {"MOONLEASE_SETTINGS_FILE": "/e"}) == SettingsDelivery("/x", 0)
    with pytest.raises(ConnectorConfigError, match="port"):
        delivery_from_sources({"mooncake_settings_file": "/x", "mooncake_settings_metrics_port": "http"})
    # The delivery keys are known to the start-up config (not "unknown Moonlease key").
    MoonleaseConnectorConfig.from_sources({"mooncake_settings_file": "/x",
                                           "mooncake_settings_metrics_port": 9410})


# ----------------------------------------------------------- watcher + exporter, real files


def test_watcher_follows_configmap_swaps_and_the_endpoint_shows_what_runs(tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "settings")
    volume.write(render_settings_file(DEFAULTS))
    live = LiveSettings(STARTUP)
    exporter = SettingsExporter()
    exporter.show(live.current())
    port = exporter.serve(0, "127.0.0.1")
    watcher = SettingsWatcher(volume.path, live, defaults=DEFAULTS, capabilities=NEW_CLIENT,
                              layout_problem=not_hybrid, exporter=exporter)
    try:
        first = watcher.poll_once()
        assert first is not None and live.current().source is SettingsSource.FILE
        assert watcher.poll_once() is None  # nothing changed: not even re-read

        selective = MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE, junction_retention=True)
        volume.write(render_settings_file(selective))
        decision = watcher.poll_once()
        assert decision is not None and decision.switched
        assert live.current().config == selective
        info = scrape(port)["moonlease_connector_settings_info"]
        assert info == [({"lease_mode": "selective", "junction_retention": "true",
                          "settings_hash": settings_hash(selective), "source": "file"}, 1.0)]

        # Same content, new ConfigMap version (e.g. an annotation change): no switch counted.
        volume.write(render_settings_file(selective))
        assert watcher.poll_once() is None

        # A mode this model cannot run: refused, the old settings stay, and the endpoint says why.
        last_hit = MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY)
        volume.write(render_settings_file(last_hit))
        refused = watcher.poll_once()
        assert refused is not None and refused.refusal is RefusalReason.MODEL_UNSUPPORTED
        assert live.current().config == selective
        metrics = scrape(port)
        assert metrics["moonlease_connector_settings_info"][0][0]["settings_hash"] == settings_hash(selective)
        assert metrics["moonlease_connector_settings_refused_info"] == [
            ({"settings_hash": settings_hash(last_hit), "reason": "model_unsupported"}, 1.0)]
        refusals = {labels["reason"]: value for labels, value
                    in metrics["moonlease_connector_settings_refusals_total"]}
        assert refusals["model_unsupported"] == 1 and refusals["invalid"] == 0
        switches = metrics["moonlease_connector_settings_switches_total"]
        assert switches == [({}, 1.0)]

        # Back to something servable: applied, the refusal cleared.
        volume.write(render_settings_file(DEFAULTS))
        assert watcher.poll_once().switched
        metrics = scrape(port)
        assert metrics["moonlease_connector_settings_info"][0][0]["lease_mode"] == "leaseAll"
        assert "moonlease_connector_settings_refused_info" not in metrics
    finally:
        exporter.close()


def test_a_vanished_file_keeps_the_settings_and_is_reported_once(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    selective = MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE)
    path.write_text(json.dumps(selective.model_dump()))
    live = LiveSettings(STARTUP)
    watcher = SettingsWatcher(str(path), live, defaults=DEFAULTS, capabilities=NEW_CLIENT,
                              layout_problem=hybrid)
    assert watcher.poll_once().switched
    path.unlink()
    gone = watcher.poll_once()
    assert gone is not None and gone.refusal is RefusalReason.UNREADABLE and str(path) in gone.message
    assert watcher.poll_once() is None
    assert live.current().config == selective
    path.write_text(json.dumps(selective.model_dump()))
    back = watcher.poll_once()  # re-read after it came back: same settings, no switch
    assert back is not None and back.refusal is None and not back.switched


def test_the_watcher_thread_applies_a_change_without_being_asked(tmp_path: Path) -> None:
    import time

    volume = ConfigMapVolume(tmp_path / "settings")
    volume.write(render_settings_file(DEFAULTS))
    live = LiveSettings(STARTUP)
    watcher = SettingsWatcher(volume.path, live, defaults=DEFAULTS, capabilities=NEW_CLIENT,
                              layout_problem=hybrid, poll_interval_s=0.05)
    watcher.start()
    try:
        volume.write(render_settings_file(MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE)))
        deadline = time.monotonic() + 30  # generous: a loaded machine
        while live.current().config.lease_mode is not LeaseMode.SELECTIVE:
            assert time.monotonic() < deadline, "the watcher never applied the change"
            time.sleep(0.05)
    finally:
        watcher.stop()
