"""What a container runs, read as the kubelet runs it. Pure.

A container runs its `command` then its `args` (the image's entrypoint when it has no command).
When that is a shell with `-c`, the script is split into simple commands with `shlex` (quotes,
`;`, `&&`, `||`, `|`, `&`, newlines, `exec`/`env` prefixes and `VAR=value` assignments), so the
operator sees the commands a shell would run, not words that happen to appear in the text.

A container runs vLLM only when a command it runs *starts* vLLM: `vllm serve ...`, or
`python -m vllm...` (the API server module or vLLM's CLI) — never because some token ends in
`vllm` (`redis-server --dir /data/vllm`) or an image name contains it (`vllm-router`). Without a
command of its own, only the images whose entrypoint is vLLM count (`VLLM_IMAGES`, by exact
name). The manageability checks, the settings delivery and the test bed's simulated pods all ask
here (`vllm_invocations`), so they agree on what a pod runs.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh"})
#: Images whose entrypoint starts vLLM (last path component, without tag or digest): vLLM's
#: own and Moonlease's connector image (`ENTRYPOINT ["vllm"]`, see the Dockerfile).
VLLM_IMAGES = frozenset({"vllm", "vllm-openai", "vllm-connector"})
KV_TRANSFER_CONFIG_OPTIONS = ("--kv-transfer-config", "--kv_transfer_config")
_SEPARATORS = frozenset({";", "&", "&&", "|", "||", "\n", "(", ")", ";;", "|&"})
_PREFIXES = frozenset({"exec", "nohup", "time", "command"})
_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Invocation:
    """One command a container runs: its words from the program on, where it was found, and
    the environment assignments the script made before it."""

    argv: tuple[str, ...]
    script: str | None = None
    """The shell script it is part of (None: the container's own command line)."""
    env: Mapping[str, str] = field(default_factory=dict)

    def option(self, names: Sequence[str]) -> str | None:
        """The value of the last `--name value` / `--name=value` (argparse keeps the last)."""
        value = None
        for i, token in enumerate(self.argv):
            for name in names:
                if token == name and i + 1 < len(self.argv):
                    value = self.argv[i + 1]
                elif token.startswith(name + "="):
                    value = token[len(name) + 1:]
        return value

    def kv_doc(self) -> dict[str, Any] | None:
        """Its `--kv-transfer-config` as a JSON object (None: absent or not an object)."""
        text = self.option(KV_TRANSFER_CONFIG_OPTIONS)
        try:
            doc = json.loads(text) if text is not None else None
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None


def _program(token: str) -> str:
    return token.rsplit("/", 1)[-1]


def image_name(container: Mapping[str, Any]) -> str:
    """The image's last path component without tag or digest (`reg/vllm/vllm-openai:v1` -> `vllm-openai`)."""
    return str(container.get("image") or "").rsplit("/", 1)[-1].split("@", 1)[0].split(":", 1)[0]


def command_line(container: Mapping[str, Any]) -> list[str]:
    """`command` then `args` (strings only)."""
    return [t for t in (*(container.get("command") or []), *(container.get("args") or [])) if isinstance(t, str)]


def shell_script(container: Mapping[str, Any]) -> str | None:
    """The script when the container runs a shell with `-c` (`sh -c "..."`, `bash -lc "..."`), or
    a lone command-line token that is itself a script (a shell word list handed to an image whose
    entrypoint is a shell); None for a plain command line."""
    tokens = command_line(container)
    for i, token in enumerate(tokens[:-1]):
        if _program(token) in SHELLS and tokens[i + 1].startswith("-") and "c" in tokens[i + 1]:
            return tokens[i + 2] if i + 2 < len(tokens) else ""
    if not container.get("command") and len(tokens) == 1 and any(c in tokens[0] for c in " \n;&|"):
        return tokens[0]
    return None


def script_commands(script: str) -> list[Invocation] | None:
    """The simple commands of a shell script, each with the assignments in force (None: the
    script cannot be split, e.g. an unclosed quote)."""
    lexer = shlex.shlex(script.replace("\\\n", " "), posix=True, punctuation_chars=";&|()\n")
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return None
    commands: list[Invocation] = []
    exported: dict[str, str] = {}
    words: list[str] = []
    for token in [*tokens, "\n"]:
        if token not in _SEPARATORS:
            words.append(token)
            continue
        if words:
            command = _simple_command(words, exported, script)
            if command is not None:
                commands.append(command)
        words = []
    return commands


def _simple_command(words: Sequence[str], exported: dict[str, str], script: str | None) -> Invocation | None:
    """One simple command with its prefixes (`exec`, `env A=b`, `A=b`) stripped; `export A=b`
    records the assignment for the commands after it."""
    env = dict(exported)
    rest = list(words)
    while rest:
        head = rest[0]
        if _ASSIGNMENT.match(head):
            name, value = head.split("=", 1)
            env[name] = value
        elif head in _PREFIXES or head == "env":
            pass
        elif head == "export":
            for word in rest[1:]:
                if _ASSIGNMENT.match(word):
                    name, value = word.split("=", 1)
                    exported[name] = value
            return None
        else:
            break
        rest = rest[1:]
    return Invocation(argv=tuple(rest), script=script, env=env) if rest else None


def starts_vllm(argv: Sequence[str]) -> bool:
    """Whether a command starts the vLLM server: `vllm serve`, or `python -m vllm...`."""
    if not argv:
        return False
    program = _program(argv[0])
    if program == "vllm":
        return len(argv) > 1 and argv[1] == "serve"
    if _PYTHON.match(program):
        for i, word in enumerate(argv[1:], start=1):
            if word == "-m":
                module = argv[i + 1] if i + 1 < len(argv) else ""
                return module == "vllm" or module.startswith("vllm.")
            if not word.startswith("-"):
                return False  # a script file: not vLLM's module
    return False


def starts_mooncake_master(argv: Sequence[str]) -> bool:
    return bool(argv) and _program(argv[0]) == "mooncake_master"


def container_commands(container: Mapping[str, Any]) -> list[Invocation] | None:
    """Every command the container runs: its command line, or its script's simple commands
    (None: a script that cannot be split). Without a command of its own, a vLLM image runs its
    entrypoint (`vllm serve`) with the args."""
    script = shell_script(container)
    if script is not None:
        return script_commands(script)
    tokens = command_line(container)
    if not container.get("command") and image_name(container) in VLLM_IMAGES:
        tokens = ["vllm", *tokens] if tokens[:1] == ["serve"] else ["vllm", "serve", *tokens]
    command = _simple_command(tokens, {}, None)
    return [command] if command is not None else []


def vllm_invocations(container: Mapping[str, Any]) -> list[Invocation]:
    """The commands of the container that start vLLM (one for a manageable container)."""
    return [c for c in container_commands(container) or () if starts_vllm(c.argv)]


def runs_mooncake_master(container: Mapping[str, Any]) -> bool:
    """Whether a command of the container starts `mooncake_master` (or, with no command of its
    own, the image is a Mooncake master image)."""
    if any(starts_mooncake_master(c.argv) for c in container_commands(container) or ()):
        return True
    return not container.get("command") and "mooncake-master" in image_name(container)
