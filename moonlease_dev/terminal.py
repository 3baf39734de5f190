"""Styling terminal output: bold only on a terminal, never when NO_COLOR is set (no-color.org: any
non-empty value), so logs, pipes and CI output carry no escape codes."""

from __future__ import annotations

import os
import sys
from typing import TextIO


def use_color(stream: TextIO | None = None) -> bool:
    stream = sys.stdout if stream is None else stream
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def bold(text: str, stream: TextIO | None = None) -> str:
    return f"\033[1m{text}\033[0m" if use_color(stream) else text
