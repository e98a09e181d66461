"""The GPU check's report: one JSON and one markdown file in the output folder, rewritten after every part, and merged
across runs into the same folder (a part run again replaces its entry; the others stay). Imports no JAX."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from gpu_parts import PARTS
from gpu_parts.context import REPO, markdown_table

REPORT_JSON = "gpu_check.json"
REPORT_MARKDOWN = "gpu_check.md"
COMBINED_LOG = "gpu_check.log"  # every part's output, appended run after run (the tail of each, if long)
LOG_TAIL_BYTES = 2 * 2**20  # a part's share of the combined log
ERROR_TAIL_CHARS = 3000  # of a failed part's output, kept in the JSON and shown in the markdown
FINGERPRINTED = ("jaxserve", "kernels_pallas", "benchmarks", "configs")  # what the figures depend on
STATUS_OK = "ok"


def empty_report() -> dict[str, Any]:
    return {"parts": {}, "runs": []}


def load_report(out_dir: Path) -> dict[str, Any]:
    """The report already in the folder (an earlier group's), or a new one."""
    path = out_dir / REPORT_JSON
    if not path.exists():
        return empty_report()
    try:
        report = json.loads(path.read_text())
    except ValueError:  # a report cut short by a killed run: start again rather than fail
        return empty_report()
    return report if isinstance(report, dict) and "parts" in report else empty_report()


def save_report(out_dir: Path, report: dict[str, Any]) -> None:
    """Both files, each written whole then renamed into place: a run killed mid-write leaves the previous one."""
    for name, text in ((REPORT_JSON, json.dumps(report, indent=1, default=str)), (REPORT_MARKDOWN, markdown(report))):
        partial = out_dir / f".{name}.partial"
        partial.write_text(text)
        os.replace(partial, out_dir / name)


def append_log(out_dir: Path, header: str, part_log: Path) -> None:
    data = part_log.read_bytes() if part_log.exists() else b""
    with open(out_dir / COMBINED_LOG, "ab") as log:
        log.write(f"\n===== {header}\n".encode())
        log.write(data[-LOG_TAIL_BYTES:])


def log_tail(part_log: Path) -> str:
    if not part_log.exists():
        return ""
    return part_log.read_bytes()[-ERROR_TAIL_CHARS:].decode(errors="replace")


def source_revision() -> dict[str, Any]:
    """The git commit (with whether tracked files differ from it), or None where the tree is not a checkout; and a
    hash of the sources the figures depend on, which names the tree either way."""
    commit, changed = None, None
    try:
        commit = _git("rev-parse", "HEAD")
        changed = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        pass  # no git, or no .git: the source hash alone names the tree
    return {"commit": commit, "uncommitted_changes": changed, "source_sha256": source_fingerprint()}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def source_fingerprint() -> str:
    digest = hashlib.sha256()
    for folder in FINGERPRINTED:
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".yaml", ".json") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def revision_text(revision: dict[str, Any]) -> str:
    if revision["commit"] is None:
        return f"no git checkout; sources sha256 {revision['source_sha256']}"
    changes = " + uncommitted changes" if revision["uncommitted_changes"] else ""
    return f"commit {revision['commit'][:12]}{changes} (sources sha256 {revision['source_sha256']})"


def device_text(report: dict[str, Any]) -> str:
    env = report["parts"].get("env", {}).get("outcome")
    if env is None:
        return "device unknown (the env part has not run)"
    figures = env["figures"]
    smi = figures["nvidia_smi"] or {}
    driver = smi["gpus"][0]["driver_version"] if smi.get("gpus") else None
    packages = figures["packages"]
    return (f"{figures['machine']['device']} ({figures['machine']['jax_backend']})"
            + (f", driver {driver}, CUDA {smi.get('cuda_version')}" if driver else "")
            + f"; jax {packages['jax']}, jaxlib {packages['jaxlib']}")


def status_text(entry: dict[str, Any]) -> str:
    return entry["status"] if entry["status"] == STATUS_OK else f"**{entry['status']}**"


def part_section(name: str, entry: dict[str, Any]) -> str:
    lines = [f"## {name}", "", entry["about"], ""]
    if entry.get("outcome") is not None:
        lines.append(entry["outcome"]["summary"])
    if entry["status"] not in (STATUS_OK, "check_failed"):
        lines += ["", f"{entry['status']}: {entry.get('error') or ''}", "", "```", entry.get("log_tail", ""), "```"]
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    runs = report["runs"]
    last = runs[-1] if runs else {}
    header = ["# jaxserve GPU check", "",
              f"- Device: {device_text(report)}",
              f"- Source: {revision_text(last['revision'])}" if last else "- Source: unknown",
              "- Runs: " + "; ".join(f"{run['started_at']} ({run['mode']}: {', '.join(run['parts'])})"
                                      for run in runs), ""]
    entries = [(part.name, report["parts"][part.name]) for part in PARTS if part.name in report["parts"]]
    rows = [[name, entry["group"], status_text(entry), f"{entry.get('seconds', 0):.0f}", f"{entry['budget_s']:.0f}",
             entry.get("started_at", "")] for name, entry in entries]
    table = markdown_table(["part", "group", "status", "seconds", "budget s", "started"], rows)
    sections = [part_section(name, entry) for name, entry in entries]
    return "\n".join(header) + "\n" + table + "\n\n" + "\n\n".join(sections) + "\n"
