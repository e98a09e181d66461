"""The clients `reliability.py` sends: each kind streams one /v1/completions request and reports what it saw.

    normal    reads its stream to `data: [DONE]`
    leaver    reads a few events, then closes its connection mid-stream
    sluggish  reads slowly but steadily (a small receive buffer, short pauses): the server's sends wait, each for
              less than --stream-timeout, and the stream must complete
    stalled   reads the first event, then nothing for longer than --stream-timeout while a large response (top-20
              logprobs on every token) fills the connection's buffers: the server should drop it (no [DONE])

The slow kinds use raw sockets with a 1 KiB receive buffer and a small segment size, so the server's sends block
after some tens of KiB instead of the megabytes loopback buffers otherwise absorb.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from typing import Any

import httpx

DONE_EVENT = b"data: [DONE]"
ERROR_EVENT = b'data: {"error"'
SLOW_RCVBUF = 1024  # bytes: the slow kinds' socket receive buffer
SLOW_MSS = 536  # bytes: their TCP segment size (the smallest IPv4 default)
SLOW_READ_BYTES = 4096  # the most a slow reader takes per read
SLUGGISH_PAUSE_S = 0.005  # between a sluggish reader's reads: ~200 KB/s, well within any --stream-timeout
KINDS = ("normal", "leaver", "sluggish", "stalled")


@dataclasses.dataclass(frozen=True)
class ClientSpec:
    """One request and how its client behaves."""

    index: int  # position in the run
    kind: str  # one of KINDS
    key_name: str  # the API key it sends, by name
    priority: int  # the request's scheduling priority (lower runs first)
    body: dict[str, Any]  # the /v1/completions body (streamed)
    leave_after: int = 0  # leaver: events read before closing
    stall_s: float = 0.0  # stalled: seconds without reading after the first event


@dataclasses.dataclass(frozen=True)
class ClientResult:
    """What one client saw."""

    index: int  # the spec's index
    status: int | None  # HTTP status; None when no response came
    outcome: str  # completed, left, dropped (ended without [DONE]), stream_error, http_STATUS or transport_error
    ttft_s: float | None  # request sent to its first event; None without one
    detail: str = ""  # the error message of a failure, shortened


async def run_client(spec: ClientSpec, http: httpx.AsyncClient, base_url: str, key: str) -> ClientResult:
    """Runs the client `spec.kind` describes; never raises (a failure is an outcome)."""
    try:
        if spec.kind in ("normal", "leaver"):
            return await _httpx_client(spec, http, key)
        return await _raw_client(spec, base_url, key)
    except (OSError, httpx.HTTPError, asyncio.IncompleteReadError) as e:
        return ClientResult(spec.index, None, "transport_error", None, f"{type(e).__name__}: {e}"[:200])


async def _httpx_client(spec: ClientSpec, http: httpx.AsyncClient, key: str) -> ClientResult:
    start = time.perf_counter()
    ttft = None
    events = 0
    async with http.stream("POST", "/v1/completions", json=spec.body,
                           headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            return ClientResult(spec.index, response.status_code, f"http_{response.status_code}", None, body[:200])
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            if line.encode().startswith(ERROR_EVENT):
                return ClientResult(spec.index, 200, "stream_error", ttft, line[:200])
            if line.encode() == DONE_EVENT:
                return ClientResult(spec.index, 200, "completed", ttft)
            events += 1
            if spec.kind == "leaver" and events >= spec.leave_after:
                return ClientResult(spec.index, 200, "left", ttft)  # leaving the block closes the connection
    return ClientResult(spec.index, 200, "dropped", ttft)


async def _raw_client(spec: ClientSpec, base_url: str, key: str) -> ClientResult:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await _small_buffer_connection(host, int(port))
    try:
        start = time.perf_counter()
        writer.write(_request_bytes(spec.body, f"{host}:{port}", key))
        received, ttft = await _read_to_first_event(reader, start)
        status = _status(received)
        if status == 200 and spec.kind == "stalled":
            await asyncio.sleep(spec.stall_s)  # the client reads nothing meanwhile: the server's sends block
        while chunk := await reader.read(SLOW_READ_BYTES):
            received += chunk
            if spec.kind == "sluggish":
                await asyncio.sleep(SLUGGISH_PAUSE_S)
    finally:
        writer.close()
    return ClientResult(spec.index, status, _raw_outcome(status, received), ttft,
                        "" if status == 200 else received[-200:].decode(errors="replace"))


async def _small_buffer_connection(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, SLOW_MSS)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    # A small stream limit: asyncio stops reading the socket at twice it, so the bytes wait in the kernel.
    return await asyncio.open_connection(sock=sock, limit=SLOW_READ_BYTES)


def _request_bytes(body: dict[str, Any], host: str, key: str) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    return head.encode() + payload


async def _read_to_first_event(reader: asyncio.StreamReader, start: float) -> tuple[bytes, float | None]:
    """What arrived up to the first event (or the end of an answer without events), and when that event came."""
    received = b""
    while b"data: " not in received:
        chunk = await reader.read(SLOW_READ_BYTES)
        if not chunk:
            return received, None
        received += chunk
    return received, time.perf_counter() - start


def _status(received: bytes) -> int | None:
    parts = received.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else None


def _raw_outcome(status: int | None, received: bytes) -> str:
    if status != 200:
        return f"http_{status}" if status is not None else "transport_error"
    if ERROR_EVENT in received:
        return "stream_error"
    return "completed" if DONE_EVENT in received else "dropped"
