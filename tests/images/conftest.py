"""Fixtures of the image smoke tests: the images `make images` builds (built here by the same
script: a no-op when they are current, a full build on a fresh machine), and one podman network."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from tests.images.podman import IMAGES_SCRIPT, Network, image_name


def _run_images_script(argument: str, timeout_s: int) -> None:
    result = subprocess.run(["bash", str(IMAGES_SCRIPT), argument], capture_output=True, text=True,
                            timeout=timeout_s, env=os.environ)
    assert result.returncode == 0, \
        f"tools/images.sh {argument} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


class Images:
    """target -> image name, each target built by `tools/images.sh TARGET` on first use (the
    script is quick when the image is current: podman reuses every cached layer)."""

    def __init__(self) -> None:
        self._built: dict[str, str] = {}
        self._prepared = False

    def prepare(self) -> None:
        """podman installed and configured, nothing built (`tools/images.sh --prepare`): on a
        fresh machine podman arrives with the first build, and a network is made before that."""
        if not self._prepared:
            _run_images_script("--prepare", timeout_s=1800)
            self._prepared = True

    def __getitem__(self, target: str) -> str:
        if target not in self._built:
            _run_images_script(target, timeout_s=3600)
            self._built[target] = image_name(target)
        return self._built[target]


@pytest.fixture(scope="session")
def images() -> Images:
    return Images()


@pytest.fixture(scope="module")
def network(images: Images) -> Iterator[Network]:
    images.prepare()
    created = Network.create()
    try:
        yield created
    finally:
        created.remove()
