"""The marked examples of the documentation pages (docs/development.md, "Examples that run", says how to mark one):
found, and run in a folder that looks like a checkout."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNS = "runs-on-cpu"  # <!-- runs-on-cpu --> before a fence: the test runs the block
WITH_SERVER = "runs-on-cpu: server"  # ... while a server on the built-in model runs
FILE = "file:"  # <!-- file: NAME -->: the block is written to NAME for the blocks after it
DOCS_SERVER_ADDRESS = "127.0.0.1:8000"  # what the examples call; replaced by the test server's address
BLOCK_TIMEOUT_S = 300  # a cold compilation cache: the built-in model's programs compile in about a minute


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block and the marker on the line before it (None when unmarked)."""

    page: Path
    line: int  # where its fence opens, 1-based
    language: str
    text: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


_MARKER = re.compile(r"<!--\s*(.*?)\s*-->")
_FENCE = re.compile(r"^```(\w*)\s*$")


def blocks(page: Path) -> list[Block]:
    """Every fenced block of the page, in order."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = _MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        found.append(Block(page, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                           marker.group(1) if marker else None))
        i = end + 1
    return found


def marked(page: Path) -> list[Block]:
    """The blocks the test runs or writes."""
    return [b for b in blocks(page) if b.marker in (RUNS, WITH_SERVER) or (b.marker or "").startswith(FILE)]


def checkout_view(folder: Path) -> Path:
    """A folder whose entries link to the repository's top level, its .venv the running interpreter's: commands run
    there as from a checkout, and what they write stays out of it."""
    folder.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv"):
            (folder / entry.name).symlink_to(entry)
    (folder / ".venv").symlink_to(Path(sys.prefix))
    return folder


def run(block: Block, folder: Path, server_address: str | None) -> subprocess.CompletedProcess:
    """Runs a marked block in `folder` (a file block is written instead)."""
    if block.marker.startswith(FILE):
        (folder / block.marker[len(FILE):].strip()).write_text(block.text)
        return subprocess.CompletedProcess([], 0, "", "")
    text = block.text.replace(DOCS_SERVER_ADDRESS, server_address) if server_address else block.text
    if block.language == "python":
        script = folder / f"doc_block_{block.line}.py"
        script.write_text(text)
        command = [sys.executable, str(script)]
    elif block.language == "bash":
        command = ["bash", "-e", "-c", text]
    else:
        raise AssertionError(f"{block.where}: a runnable block must be bash or python, not {block.language!r}")
    env = {**os.environ, "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
