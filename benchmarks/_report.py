"""Write one script's section into its page (between markers), keeping the page's other sections.

Performance benchmarks write `docs/benchmarks.md` (`write_section`): sections that a rerun refreshes in place.
Studies (training runs, drafters compared on held-out prompts, τ against compute) write a dated page under
`docs/studies/` (`write_study`): by default a new page `docs/studies/<today>-<name>.md`, listed in
`docs/studies/README.md`; `--page PATH` of a study script adds the section to an existing page instead.
"""

from __future__ import annotations

import platform
import re
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
STUDIES = ROOT / "docs" / "studies"
INDEX = STUDIES / "README.md"
HEADER = ("# Benchmarks\n\nPerformance measured side by side in one run. Every section is written by the script it "
          "names; rerun the command to refresh it. One-off studies live in [studies](studies/README.md).\n")


def machine() -> str:
    import os

    import jax

    device = jax.devices()[0]
    accelerator = "" if device.platform == "cpu" else f"one {device.device_kind} ({device.platform}) beside "
    return (f"{accelerator}{platform.machine()} CPU, {os.cpu_count()} cores, jax {jax.__version__} "
            f"({device.platform}), {date.today().isoformat()}")


def write_section(name: str, body: str, doc: Path = DOC, header: str = HEADER) -> Path:
    """Put `body` between the markers of section `name` of `doc` (appended when new); `header` starts a new doc."""
    text = doc.read_text() if doc.exists() else header
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return doc


def study_page(name: str, page: str | Path | None = None) -> Path:
    """The study page a section goes to: `page` when given, else docs/studies/<today>-<name>.md."""
    if page is not None:
        return Path(page)
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return STUDIES / f"{date.today().isoformat()}-{slug}.md"


def write_study(name: str, body: str, page: str | Path | None = None) -> Path:
    """Write section `name` into its study page (`study_page`); a new page gets a title from the section's
    heading and a line in the index (docs/studies/README.md)."""
    path = study_page(name, page)
    new = not path.exists()
    heading = next((line[3:].strip() for line in body.splitlines() if line.startswith("## ")), name)
    header = (f"# {date.today().isoformat()}: {heading}\n\nA study page: each section names the command that wrote "
              "it and its date. Index: [studies](README.md).\n")
    write_section(name, body, path, header=header)
    if new and path.resolve().parent == STUDIES.resolve():
        index = INDEX.read_text() if INDEX.exists() else "# Studies\n"
        INDEX.write_text(index.rstrip() + f"\n- [{path.stem[:10]}: {heading}]({path.name})\n")
    return path
