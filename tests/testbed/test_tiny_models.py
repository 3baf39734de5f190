"""Tiny local models: tokenizer, cache, determinism, and that each model is what it claims."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moonlease_dev.testbed import tiny_models as tm

pytestmark = pytest.mark.vllm


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tokenizer_round_trips_text(tiny_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    assert len(tokenizer) == tm.VOCAB_SIZE
    texts = ["The cache holds the key and the value.",
             "  leading spaces, tabs\tand\nnewlines; numbers 12345!",
             "Ünïcødé and emoji 🚀 are bytes too: 日本語"]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id == tm.BOS_ID
        assert tokenizer.unk_token_id not in ids
        assert all(0 <= i < tm.VOCAB_SIZE for i in ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # The BPE learned merges from its corpus: common words are far fewer tokens than bytes.
    common = "the cache block prefix token lease store"
    assert len(tokenizer(common, add_special_tokens=False)["input_ids"]) <= len(common.split()) + 1


def test_models_are_the_architectures_they_claim(tiny_models):
    from transformers import AutoConfig

    llama = AutoConfig.from_pretrained(tiny_models["llama"])
    assert (llama.architectures, llama.hidden_size, llama.num_hidden_layers, llama.head_dim,
            llama.vocab_size) == (["LlamaForCausalLM"], 64, 2, 32, 1024)

    hybrid = AutoConfig.from_pretrained(tiny_models["hybrid"])
    assert hybrid.architectures == ["NemotronHForCausalLM"]
    assert "M" in hybrid.hybrid_override_pattern and "*" in hybrid.hybrid_override_pattern

    swa = AutoConfig.from_pretrained(tiny_models["swa"])
    assert swa.architectures == ["Gemma3ForCausalLM"]
    assert {"sliding_attention", "full_attention"} <= set(swa.layer_types)
    assert swa.sliding_window == 64

    for name in tm.TINY_MODELS:
        manifest = json.loads((tiny_models[name] / tm.MANIFEST).read_text())
        assert tiny_models[name].name == f"{name}-{manifest['hash']}"
        assert (tiny_models[name] / "model.safetensors").is_file()


def test_second_build_reuses_the_cache(tmp_path, monkeypatch):
    first = tm.build_tiny_model("llama", tmp_path)
    assert first.parent == tmp_path and tm.is_built(first)
    weights = _sha(first / "model.safetensors")

    def must_not_build(*_args, **_kwargs):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tm, "_materialize", must_not_build)
    assert tm.build_tiny_model("llama", tmp_path) == first
    assert _sha(first / "model.safetensors") == weights
    # A new builder version is a different cache entry, so it would build again.
    monkeypatch.setattr(tm, "BUILDER_VERSION", tm.BUILDER_VERSION + 1)
    assert tm.model_dir("llama", tmp_path) != first
    with pytest.raises(AssertionError, match="rebuilt"):
        tm.build_tiny_model("llama", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [first.name]   # no staging dir left behind


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(tm.CACHE_ENV, str(tmp_path))
    assert tm.default_cache_dir() == tmp_path / "tiny-models"
    assert tm.model_dir("swa").parent == tmp_path / "tiny-models"


def test_concurrent_cli_builds_agree_and_are_deterministic(tmp_path, tiny_models):
    """Two processes build the same model at once: one complete copy, same bytes as any build."""
    cmd = [sys.executable, "-m", "moonlease_dev.testbed.tiny_models", "build", "llama",
           "--cache-dir", str(tmp_path)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (_out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    built = tmp_path / tiny_models["llama"].name
    assert [out.strip().splitlines()[-1] for out, _ in results] == [f"llama: {built}"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [built.name]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(built / name) == _sha(tiny_models["llama"] / name), name


def test_unknown_model_is_refused(tmp_path):
    with pytest.raises(KeyError, match="unknown tiny model"):
        tm.build_tiny_model("gpt5", tmp_path)
    assert set(tm.TINY_MODELS) == {"llama", "hybrid", "swa", "hybrid-serve", "swa-serve"}
    assert all(spec.description for spec in tm.TINY_MODELS.values())
