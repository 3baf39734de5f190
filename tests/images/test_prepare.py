"""`tools/images.sh --prepare`: podman installed and configured without building anything, which
the `network` fixture relies on (on a fresh machine podman arrives with the first build, and an
image test makes its network before it asks for an image)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.images.podman import IMAGES_SCRIPT

pytestmark = pytest.mark.images

CONF = Path("/etc/containers/containers.conf.d/50-moonlease.conf")


def test_prepare_installs_and_configures_podman_and_builds_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    result = subprocess.run(["bash", str(IMAGES_SCRIPT), "--prepare"], capture_output=True, text=True,
                            timeout=1800, env={**os.environ, "MOONLEASE_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    assert "podman is installed and configured" in result.stdout
    assert "building" not in result.stdout and "rootfs" not in result.stdout
    assert shutil.which("podman") is not None
    assert 'runtime = "runc"' in CONF.read_text()
    assert not list((cache / "images").glob("build-*.log"))  # nothing built
    assert subprocess.run(["podman", "network", "ls"], capture_output=True, timeout=60).returncode == 0
