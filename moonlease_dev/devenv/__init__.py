"""The development environment on a CPU machine: where things are, and how to load Mooncake.

Not used in production. The CUDA 13 Mooncake wheel (the only 0.3.14 build on PyPI) needs
`libcudart.so.13` and `libcuda.so.1`; on a machine without a driver we put the PyPI CUDA runtime
and our stub (`libcuda_stub.c`) on the library path of every process that loads Mooncake, and
preload both into this interpreter so an in-process `import mooncake.store` works too.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The checkout's source roots: the settings contract, the connector, the operator, and the root
#: (the command line and this package). A child interpreter given them on PYTHONPATH
#: (`source_pythonpath`) imports this checkout's code, whatever an editable install points at.
SOURCE_ROOTS = (REPO_ROOT / "settings", REPO_ROOT / "connector", REPO_ROOT / "operator", REPO_ROOT)
STUB_SOURCE = Path(__file__).with_name("libcuda_stub.c")


def source_pythonpath(*first: Path | str, then: str | None = None) -> str:
    """A PYTHONPATH of `first`, the checkout's `SOURCE_ROOTS`, then `then` (an inherited one)."""
    return os.pathsep.join([*map(str, first), *map(str, SOURCE_ROOTS), *([then] if then else [])])


def stub_dir() -> Path:
    """Where `make setup` puts the stub: inside the active virtualenv, so it never leaks out."""
    return Path(sys.prefix) / "lib" / "moonlease-cuda-stub"


def cudart_dir() -> Path | None:
    """The PyPI CUDA runtime's library folder, if `nvidia-cuda-runtime` is installed."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        for candidate in (Path(base) / "cu13" / "lib", Path(base) / "cuda_runtime" / "lib"):
            if (candidate / "libcudart.so.13").exists():
                return candidate
    return None


def library_dirs() -> list[Path]:
    return [d for d in (stub_dir(), cudart_dir()) if d is not None and d.exists()]


def library_path_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment whose LD_LIBRARY_PATH lets Mooncake 0.3.14 load on this CPU machine."""
    env = dict(os.environ if base is None else base)
    existing = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    wanted = [str(d) for d in library_dirs()]
    env["LD_LIBRARY_PATH"] = ":".join(wanted + [p for p in existing if p not in wanted])
    return env


def preload() -> None:
    """Load the runtime and the stub into this process (RTLD_GLOBAL) before `import mooncake`.

    The dynamic linker satisfies a later `libcuda.so.1` dependency from an already loaded
    library with that soname, so this works without restarting the interpreter. Children
    started after this call inherit the environment variable as well.
    """
    os.environ.update({"LD_LIBRARY_PATH": library_path_env()["LD_LIBRARY_PATH"]})
    cudart = cudart_dir()
    if cudart is not None:
        ctypes.CDLL(str(cudart / "libcudart.so.13"), mode=ctypes.RTLD_GLOBAL)
    stub = stub_dir() / "libcuda.so.1"
    if stub.exists():
        ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)


def build_stub() -> Path:
    target = stub_dir() / "libcuda.so.1"
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise SystemExit("gcc not found: install it (apt-get install gcc) and run `make setup` again")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1",
                    "-o", str(target), str(STUB_SOURCE)], check=True)
    return target


def old_mooncake_python() -> Path:
    """The interpreter of the separate Mooncake 0.3.13.post1 install (compatibility tests)."""
    override = os.environ.get("MOONLEASE_MOONCAKE_0313_PYTHON")
    return Path(override) if override else REPO_ROOT / ".venv-mooncake-0.3.13" / "bin" / "python"


def main(argv: list[str]) -> int:
    if argv[:1] == ["build-stub"]:
        print(build_stub())
        return 0
    if argv[:1] == ["env"]:
        print(f"export LD_LIBRARY_PATH={library_path_env()['LD_LIBRARY_PATH']}")
        return 0
    print("usage: python -m moonlease_dev.devenv build-stub|env", file=sys.stderr)
    return 2
