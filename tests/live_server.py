"""Starts the real `jaxserve serve` on 127.0.0.1 in a subprocess, for tests that talk HTTP to it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TINY_CONFIG = ROOT / "configs" / "tiny-cpu.yaml"
START_TIMEOUT_S = 300  # model load and warm-up compiles; the persistent compile cache makes later starts quick


@dataclasses.dataclass
class LiveServer:
    """A running server process and where to reach it."""

    base_url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen  # the `jaxserve serve` process
    log_path: Path  # its combined stdout and stderr

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, then wait for the exit code (SIGKILL if it does not come)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"the server did not exit within {timeout} s of SIGTERM:\n{self.log()[-4000:]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(tmp_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[LiveServer]:
    """A server on the built-in tiny model with extra command-line `flags`; stopped when the block ends."""
    port = free_port()
    log_path = tmp_dir / f"server-{port}.log"
    command = [sys.executable, "-m", "jaxserve.cli", "serve", "--config", str(TINY_CONFIG), "--port", str(port), *flags]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env={**os.environ, **(env or {})})
    server = LiveServer(f"http://127.0.0.1:{port}", process, log_path)
    try:
        _wait_until_ready(server)
        yield server
    finally:
        server.terminate()


def _wait_until_ready(server: LiveServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"the server exited with {server.process.returncode}:\n{server.log()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"the server did not become healthy within {START_TIMEOUT_S} s:\n{server.log()[-4000:]}")



@contextlib.contextmanager
def completions_meanwhile(base_url: str, body: dict, headers: dict[str, str] | None = None) -> Iterator[list[dict]]:
    """Sends `body` to /v1/completions again and again on a thread while the block runs, so that requests are in
    flight during whatever the block sends; yields the list their answers (JSON) are appended to."""
    answers: list[dict] = []
    done = threading.Event()

    def repeat() -> None:
        with httpx.Client(base_url=base_url, headers=headers or {}, timeout=120) as client:
            while not done.is_set():
                answers.append(client.post("/v1/completions", json=body).json())

    thread = threading.Thread(target=repeat, name="completions-meanwhile")
    thread.start()
    try:
        yield answers
    finally:
        done.set()
        thread.join()
