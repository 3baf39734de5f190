"""Nothing of the build host's configuration is in an image: `make images` mounts the host's CA
bundle, a generated pip.conf and the local wheel folders into RUN steps only."""

from __future__ import annotations

import pytest

from tests.images.conftest import Images
from tests.images.podman import podman

pytestmark = pytest.mark.images

BASE = "localhost/moonlease-base/python:3.11-bookworm"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def _sh(image: str, script: str) -> str:
    return podman("run", "--rm", "--read-only", "--user", "0", "--entrypoint", "sh", image, "-c", script).stdout


@pytest.mark.parametrize("target", ["operator", "mooncake", "connector-cpu"])
def test_no_host_configuration_is_baked_into_an_image(images: Images, target: str) -> None:
    image = images[target]
    leftovers = _sh(image, "for p in /etc/pip.conf /etc/xdg/pip /root/.config/pip /root/.cache/pip /run/host-wheels "
                           "/opt/wheels; do [ -e $p ] && echo $p; done; true")
    assert leftovers == ""
    # The CA bundle is the Debian base's, not the host's (which holds a proxy's CA).
    assert _sh(image, f"sha256sum {CA_BUNDLE}") == _sh(BASE, f"sha256sum {CA_BUNDLE}")
    env = podman("image", "inspect", "--format", "{{json .Config.Env}}", image).stdout
    assert "PIP_FIND_LINKS" not in env and "PIP_CERT" not in env and "/opt/wheels" not in env
