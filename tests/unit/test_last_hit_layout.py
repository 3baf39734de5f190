"""Last-hit-only's start-up gate against vLLM's own spec → manager registry.

Every spec class vLLM registers is listed here with the verdict it must get: accepted exactly
when vLLM serves it with `FullAttentionManager` (MLA included) or, for Mamba, `MambaManager` in
align mode. The list must cover the registry, so a spec a new vLLM release registers fails this
test until someone decides its verdict. Runs against vLLM 0.33.0's registry too (tests/compat).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.v1 import kv_cache_interface as kv
from vllm.v1.kv_cache_interface import KVCacheGroupSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from moonlease_connector.adapters.vllm_last_hit import check_last_hit_only_layout, serving_of
from moonlease_settings.config import ConnectorConfigError
from moonlease_connector.core.last_hit_layout import (
    GroupServing,
    ManagerKind,
    last_hit_only_layout_problems,
)

pytestmark = pytest.mark.compat

ATTENTION = dict(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float16)
EXTRA = {"SlidingWindowSpec": dict(sliding_window=64), "SlidingWindowMLASpec": dict(sliding_window=64),
         "ChunkedLocalAttentionSpec": dict(attention_chunk_size=64), "RSWASpec": dict(rswa_window=64),
         "HiSparseHotSpec": dict(block_size=16, page_size=1, blocks_per_request=4),
         "HiSparseResidentSpec": dict(block_size=16, page_size=1)}

ACCEPTED, REFUSED, NO_PART = "accepted", "refused", "takes no part"
#: Every spec vLLM registers (and one it does not), with the verdict last-hit-only must give.
#: "takes no part": the spec opts out of prefix caching, so neither vLLM's lookup nor ours
#: looks at its group, and it cannot make the mode unsound.
KV_SPEC_VERDICTS = {
    "FullAttentionSpec": ACCEPTED,
    "MLAAttentionSpec": ACCEPTED,  # Kimi's KDA + MLA models: the family the mode is named for
    "HiddenStateCacheSpec": ACCEPTED,  # registered to FullAttentionManager
    "SlidingWindowSpec": REFUSED,
    "SlidingWindowMLASpec": REFUSED,
    "ChunkedLocalAttentionSpec": REFUSED,
    "CrossAttentionSpec": REFUSED,
    "RSWASpec": REFUSED,  # a FullAttentionSpec subclass served by RSWAManager
    "SinkFullAttentionSpec": REFUSED,  # a FullAttentionSpec subclass served by SinkFullAttentionManager
    "EncoderOnlyAttentionSpec": REFUSED,  # no manager registered at all
    "CircularBufferSpec": NO_PART,
    "HiSparseHotSpec": NO_PART,
    "HiSparseResidentSpec": NO_PART,
}


def build_spec(name: str):
    cls = getattr(kv, name)
    if name in EXTRA and "page_size" in EXTRA[name]:
        return cls(**EXTRA[name])
    return cls(**ATTENTION, **EXTRA.get(name, {}))


def mamba(mode: str = "align", block_size: int = 64):
    return kv.MambaSpec(block_size=block_size, shapes=((4,),), dtypes=(torch.float16,), mamba_cache_mode=mode)


def groups(*specs) -> list[KVCacheGroupSpec]:
    return [KVCacheGroupSpec(layer_names=[f"layer{i}"], kv_cache_spec=spec) for i, spec in enumerate(specs)]


def registered_spec_names() -> set[str]:
    from vllm.v1 import kv_cache_spec_registry as registry
    KVCacheSpecRegistry.get_manager_class(mamba())  # registration is lazy
    return {cls.__name__ for cls in registry._REGISTRY_KVCACHESPEC_LIST}


def test_the_verdict_table_covers_every_spec_vllm_registers() -> None:
    assert registered_spec_names() <= set(KV_SPEC_VERDICTS) | {"MambaSpec"}


@pytest.mark.parametrize("name", sorted(KV_SPEC_VERDICTS))
def test_each_kv_spec_beside_align_mamba(name: str) -> None:
    spec = build_spec(name)
    layout = groups(spec, mamba())
    assert spec.prefix_cacheable == (KV_SPEC_VERDICTS[name] != NO_PART)
    if KV_SPEC_VERDICTS[name] != REFUSED:
        check_last_hit_only_layout(layout, {})
    else:
        with pytest.raises(ConnectorConfigError, match=f"group 0: {name}"):
            check_last_hit_only_layout(layout, {})


def test_mla_is_judged_by_its_manager_not_its_class() -> None:
    serving = serving_of(0, groups(build_spec("MLAAttentionSpec"))[0])
    assert serving.kind is ManagerKind.FULL_ATTENTION and serving.manager_name == "FullAttentionManager"
    rswa = serving_of(0, groups(build_spec("RSWASpec"))[0])
    assert isinstance(build_spec("RSWASpec"), kv.FullAttentionSpec)
    assert rswa.kind is ManagerKind.OTHER and rswa.manager_name == "RSWAManager"


@pytest.mark.parametrize(("mode", "accepted"), [("align", True), ("none", False), ("all", False)])
def test_mamba_only_in_align_mode(mode: str, accepted: bool) -> None:
    layout = groups(build_spec("MLAAttentionSpec"), mamba(mode))
    if accepted:
        check_last_hit_only_layout(layout, {})
    else:
        with pytest.raises(ConnectorConfigError, match=f"mamba_cache_mode='{mode}', needs 'align'"):
            check_last_hit_only_layout(layout, {})


def test_recurrent_only_models_are_accepted() -> None:
    check_last_hit_only_layout(groups(mamba(), mamba()), {})


@pytest.mark.parametrize(("value", "refused"), [
    (True, True), ("true", True), ("True", True), (" TRUE ", True),
    (False, False), ("false", False), ("0", False), (None, False),
])
def test_enable_group_semantics_is_refused_only_when_on(value, refused: bool) -> None:
    extra = {} if value is None else {"enable_group_semantics": value}
    if refused:
        with pytest.raises(ConnectorConfigError, match="enable_group_semantics=true"):
            check_last_hit_only_layout(groups(build_spec("FullAttentionSpec"), mamba()), extra)
    else:
        check_last_hit_only_layout(groups(build_spec("FullAttentionSpec"), mamba()), extra)


def test_a_hisparse_role_group_is_refused_even_with_a_full_attention_spec() -> None:
    layout = groups(build_spec("FullAttentionSpec"), mamba())
    layout[0] = dataclasses.replace(layout[0], role=kv.KVCacheGroupRole.HISPARSE_SOURCE)
    with pytest.raises(ConnectorConfigError, match="HiSparseSourceManager"):
        check_last_hit_only_layout(layout, {})


def test_every_problem_is_named_at_once() -> None:
    problems = last_hit_only_layout_problems([
        GroupServing(0, "SlidingWindowSpec", "SlidingWindowManager", ManagerKind.OTHER, 16),
        GroupServing(1, "MambaSpec", "MambaManager", ManagerKind.RECURRENT, 64, mamba_cache_mode="align"),
        GroupServing(2, "MambaSpec", "MambaManager", ManagerKind.RECURRENT, 128, mamba_cache_mode="align"),
    ], enable_group_semantics=True)
    assert len(problems) == 3
    assert "enable_group_semantics" in problems[0] and "SlidingWindowManager" in problems[1]
    assert "different block sizes [64, 128]" in problems[2]


def test_groups_outside_prefix_caching_take_no_part() -> None:
    assert last_hit_only_layout_problems([
        GroupServing(0, "SlidingWindowSpec", "SlidingWindowManager", ManagerKind.OTHER, 16,
                     prefix_cacheable=False),
        GroupServing(1, "MambaSpec", "MambaManager", ManagerKind.RECURRENT, 64, mamba_cache_mode="align"),
    ], enable_group_semantics=False) == ()


def test_a_model_without_recurrent_groups_has_nothing_to_select() -> None:
    with pytest.raises(ConnectorConfigError, match="no recurrent"):
        check_last_hit_only_layout(groups(build_spec("MLAAttentionSpec")), {})
