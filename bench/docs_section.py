"""The one writer of docs/benchmarks.md: each benchmark owns the section between its markers."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach section is written by the script it names.\n\n"


def write_section(name: str, body: str, path: Path = DOC) -> None:
    """Replace the `<!-- name:begin -->` … `<!-- name:end -->` block (appended when absent)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body}{end}\n"
    text = path.read_text() if path.exists() else HEADER
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)
