"""Reading the Dockerfile, and running a stage's steps on this machine, which has no Docker
engine: the proof that each image's install steps work, short of building the image.

`parse` reads stages, their ARG/ENV/COPY/RUN/USER/ENTRYPOINT instructions (line continuations,
`# comments`, `--mount=` and `--from=` flags). `StageRunner` replays a stage: COPY copies from
the repository (or from an earlier stage's replayed files), RUN runs in bash with the stage's
ARG and ENV values in the environment, as BuildKit does; every absolute path the Dockerfile
uses (a mount target, a stage's install prefix) is mapped onto a folder under the test's
temporary directory, and `python`/`python3` are whatever interpreter the caller says the base
image has (a clean virtualenv). What it cannot replay it does not pretend to: the base image
itself, the user switch, and a read-only root.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.chart.rendering import REPO

DOCKERFILE = REPO / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ...
    flags: Mapping[str, str]  # --from=..., --mount=... (the last of each name)
    mounts: tuple[Mapping[str, str], ...]  # every --mount=k=v,k=v
    value: str  # the rest, continuations joined
    line: int


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def args(self, global_args: Mapping[str, str]) -> dict[str, str]:
        """ARG defaults visible in the stage (a re-declared global ARG takes the global value)."""
        values: dict[str, str] = {}
        for ins in self.all("ARG"):
            name, _, default = ins.value.partition("=")
            values[name] = default if default else global_args.get(name, "")
        return values

    def env(self, global_args: Mapping[str, str], base_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The stage's ENV after its last instruction, ${VAR} expanded as Docker does."""
        scope = {**(base_env or {}), **self.args(global_args)}
        values: dict[str, str] = {}
        for ins in self.all("ENV"):
            for pair in shlex.split(ins.value):
                name, _, raw = pair.partition("=")
                values[name] = expand(raw, {**scope, **values})
        return values

    def user(self, global_args: Mapping[str, str]) -> str | None:
        users = self.all("USER")
        return expand(users[-1].value, self.args(global_args)) if users else None

    def exec_form(self, keyword: str) -> list[str] | None:
        found = self.all(keyword)
        return json.loads(found[-1].value) if found else None


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: dict[str, Stage]

    def base_image(self, stage: str) -> str:
        return expand(self.stages[stage].base, self.global_args)


def expand(text: str, variables: Mapping[str, str]) -> str:
    """${NAME} and $NAME, as Docker expands them in ENV, USER, FROM and COPY."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    lines: list[tuple[int, str]] = []
    current, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue  # comments inside a continued instruction are dropped by the parser
        if not current:
            start = number
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append((start, current + stripped))
        current = ""
    return lines


def parse(path: Path = DOCKERFILE) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    stage: Stage | None = None
    for number, line in _logical_lines(path.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        flags: dict[str, str] = {}
        mounts: list[dict[str, str]] = []
        while (flag := re.match(r"\s*--([\w-]+)=(\S*)", rest)) is not None:
            name, value = flag.groups()
            flags[name] = value
            if name == "mount":
                mounts.append(dict(part.partition("=")[::2] for part in value.split(",")))
            rest = rest[flag.end():]
        value = rest.strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+as\s+(\S+)", value, re.IGNORECASE)
            if match is None:
                raise ValueError(f"Dockerfile line {number}: every stage needs a name (FROM image AS name)")
            stage = Stage(name=match.group(2), base=match.group(1))
            stages[stage.name] = stage
        elif stage is None:
            if keyword == "ARG":
                name, _, default = value.partition("=")
                global_args[name] = default
        else:
            stage.instructions.append(Instruction(keyword, flags, tuple(mounts), value, number))
    return Dockerfile(global_args, stages)


class StageRunner:
    """Replays stages of a Dockerfile under `root` (see the module docstring).

    `paths`: image path -> local path, for every absolute path the replayed steps touch.
    `interpreters`: "python"/"python3" -> the interpreter that stands for the base image's.
    """

    def __init__(self, dockerfile: Dockerfile, root: Path, *, paths: Mapping[str, Path],
                 interpreters: Mapping[str, Path]) -> None:
        self.dockerfile = dockerfile
        self.root = root
        self.paths = dict(sorted(paths.items(), key=lambda kv: -len(kv[0])))
        self.bin = root / "base-image-bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        for name, interpreter in interpreters.items():
            # A wrapper, not a symlink: a virtualenv's python reached through a symlink elsewhere
            # finds no pyvenv.cfg and runs as the base interpreter (installing into it).
            wrapper = self.bin / name
            wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(str(interpreter))} "$@"\n')
            wrapper.chmod(0o755)
            isolated = subprocess.run([str(wrapper), "-c", "import sys; print(sys.prefix != sys.base_prefix)"],
                                      capture_output=True, text=True, check=True).stdout.strip()
            if isolated != "True":
                raise RuntimeError(f"{interpreter} is not a virtualenv: replaying would install into it")

    def local(self, image_path: str) -> str:
        """The local path standing for an absolute path of the image (text substitution on path
        boundaries: `/wheels/x.whl` maps, `/tmp/moonlease-wheels` does not)."""
        alternatives = "|".join(re.escape(prefix) for prefix in self.paths)  # longest first
        return re.sub(rf"(?<![\w./-])({alternatives})(?=[/\s\"':]|$)",
                      lambda m: str(self.paths[m.group(1)]), image_path)  # one pass: no path mapped twice

    def environment(self, stage: str, base_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The process environment of a RUN (or of the final image): this machine's, with the
        stage's ARG and ENV values (paths mapped) and the base image's interpreters first. Not
        this machine's PYTHONPATH: an image has none, and a checkout's source roots on it would
        stand in for what the stage installs."""
        st = self.dockerfile.stages[stage]
        env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
        env["PATH"] = f"{self.bin}:{env['PATH']}"
        for name, value in {**st.args(self.dockerfile.global_args),
                            **st.env(self.dockerfile.global_args, {"PATH": env["PATH"]}),
                            **(base_env or {})}.items():
            env[name] = self.local(value)
        return env

    def run_stage(self, stage: str, *, env_overrides: Mapping[str, str] | None = None, timeout: float = 600,
                  keywords: Collection[str] = ("WORKDIR", "COPY", "RUN")) -> list[subprocess.CompletedProcess[str]]:
        """COPY and RUN the instructions of `stage` in order (only `keywords`: a caller that
        cannot replay a RUN, such as apt-get into the base image, leaves RUN out and checks it
        otherwise); raises on the first failure."""
        results = []
        workdir = "/"
        for ins in self.dockerfile.stages[stage].instructions:
            if ins.keyword not in keywords:
                continue
            if ins.keyword == "WORKDIR":
                workdir = ins.value
                Path(self.local(workdir)).mkdir(parents=True, exist_ok=True)
            elif ins.keyword == "COPY":
                self._copy(ins, workdir)
            elif ins.keyword == "RUN":
                for mount in ins.mounts:
                    self._bind(mount)
                env = {**self.environment(stage), **(env_overrides or {})}
                command = self.local(ins.value)
                done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], env=env, text=True,
                                      capture_output=True, timeout=timeout, cwd=self.local(workdir))
                if done.returncode != 0:
                    raise AssertionError(f"Dockerfile line {ins.line} ({stage}) failed: {command}\n"
                                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
                results.append(done)
        return results

    def _bind(self, mount: Mapping[str, str]) -> None:
        """A bind mount is already where `paths` maps its target; check that it is there."""
        target = Path(self.local(mount["target"]))
        if not target.exists():
            raise AssertionError(f"mount target {mount['target']} is mapped to {target}, which does not exist: "
                                 f"replay the stage {mount.get('from', 'context')!r} first")

    def _copy(self, ins: Instruction, workdir: str) -> None:
        *sources, destination = shlex.split(ins.value)
        if not destination.startswith("/"):
            destination = workdir.rstrip("/") + "/" + destination
        for source in sources:
            origin = Path(self.local(source)) if "from" in ins.flags else REPO / source
            target = Path(self.local(destination))
            if origin.resolve() == target.resolve():
                continue  # the earlier stage's files are already where this stage expects them
            if origin.is_dir():
                target = target if destination.endswith("/") or len(sources) == 1 else target / origin.name
                shutil.copytree(origin, target, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
            else:
                if destination.endswith("/"):
                    target.mkdir(parents=True, exist_ok=True)
                    target = target / origin.name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)
