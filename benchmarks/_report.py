"""Write one benchmark's section into docs/benchmarks.md (between markers), keeping the others."""

from __future__ import annotations

import platform
import re
from datetime import date
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEvery section is written by the script it names; rerun the script to refresh it.\n"


def machine() -> str:
    import os

    import jax

    return (f"{platform.machine()} CPU, {os.cpu_count()} cores, jax {jax.__version__} ({jax.devices()[0].platform}), "
            f"{date.today().isoformat()}")


def write_section(name: str, body: str) -> Path:
    text = DOC.read_text() if DOC.exists() else HEADER
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    return DOC
