"""What every benchmark script under `benchmarks/` records about its run, and how it saves it.

A script's results are a JSON document (the numbers) and the markdown rendered from it (the
committed report), side by side; both name the command that made them, so the report says how to
reproduce it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def run_record(script: str, argv: Sequence[str], started: float) -> dict[str, Any]:
    """The command (`python <script> <args>`), the date (UTC) and the wall seconds since `started`
    (a `time.monotonic()` reading)."""
    return {"command": " ".join(["python", script, *argv]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "wall_s": time.monotonic() - started}


def save_results(out: Path, results: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> str:
    """Write `results` as JSON beside the markdown `render` makes of it at `out`; return the markdown."""
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    markdown = render(results)
    out.write_text(markdown)
    return markdown
