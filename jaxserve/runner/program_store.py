"""`ProgramStore`: compiled step programs kept whole on disk, so that a start whose key matches loads each one
without tracing, lowering or compiling it (JAX's persistent cache cannot skip those: its key is the lowered module).

Layout, under the store's folder:

    <scope key>/scope.json                 what the key covers, readable (runner/program_keys.py: StoreScope)
    <scope key>/<program>-<key>.jaxprog     one compiled program
    <scope key>/pool-<pages>.json           a pool size whose programs were all stored, with its workspace

Only programs XLA compiled in this process, before they run, are written: one JAX's persistent compilation cache handed
back cannot be serialized whole again (XLA:CPU's loses its machine code, and runs into "Function ... not found"),
nor can every one that has run (XLA:CPU: "`LessThan` is not serializable"), as one JAX's in-memory cache hands back
may have. A store named explicitly (`compiled_dir`, `jaxserve compile --out`) therefore compiles the programs it lacks
with that cache off (`compiling_afresh`), so that it fills; the default store, beside the cache, keeps what XLA
compiled anyway (tests/test_program_store.py starts fresh processes over one cache folder to check that none other is
kept: read back, it would load, then fail as it runs).

An entry is MAGIC, a 4-byte header length, a JSON header (key, program, payload bytes, the payload's sha256) and the
payload: the executable as `jax.experimental.serialize_executable` gives it, with its argument and result tree
structures, pickled with devices named by id and loaded onto the runner's devices of the same ids. Entries are
written under a temporary name and renamed, so a reader sees one whole or not at all. An entry that is truncated,
corrupt, stale (another key), that does not load, or whose program takes other arguments than asked is logged once
and compiled again, and rewritten: never a crash, never a wrong program.

Loading runs what an entry holds (a pickle, an XLA executable): trust a store as you trust the code; use your own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import struct
import tempfile
import threading
from pathlib import Path

import jax
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

from jaxserve.runner.program_keys import ProgramCall, StoreScope, scope_differences

log = logging.getLogger(__name__)

MAGIC = b"JAXSPRG1"
ENTRY_SUFFIX = ".jaxprog"
SCOPE_FILE = "scope.json"
KEPT_BUILDS = 2  # scopes kept of one model, settings and JAX whose sources changed (this one included)
_HEADER_LENGTH = struct.Struct(">I")


@dataclasses.dataclass(frozen=True)
class StoredPool:
    """A pool size whose programs were all stored: a start that sizes its pool from memory may take it."""

    num_pages: int  # pages, the null page included
    workspace_bytes: int  # the largest step's workspace on one device, as the pool's sizing measured it (0: unmeasured)


class ProgramStore:
    """The programs of one runner's scope in a store folder: load, save, and the pool sizes stored."""

    def __init__(self, root: Path | str, scope: StoreScope, devices: list, compile_afresh: bool = False):
        self.root = Path(root)
        self.scope = scope
        self.devices = devices  # the runner's devices, in its mesh's order: where programs load
        # The programs it lacks are compiled with JAX's persistent cache off, so that every one can be stored
        self.compile_afresh = compile_afresh
        self.folder = self.root / scope.key
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def load(self, name: str, key: str, call: ProgramCall) -> jax.stages.Compiled | None:
        """The program stored under `key` (named `name`), loaded onto the runner's devices; None where it is absent
        or unusable (logged once): the caller then compiles it."""
        path = self._entry(name, key)
        if not path.is_file():
            self._explain_missing_scope()
            return None
        try:
            compiled = _read_entry(path.read_bytes(), key, self.devices)
        except Exception as error:  # noqa: BLE001: whatever fails to read back is compiled again
            self.warn_once(f"compiled program {path.name} is unusable ({type(error).__name__}: {error}); compiling it "
                       "again")
            return None
        if not call.accepts(compiled):
            self.warn_once(f"compiled program {path.name} takes other arguments than its key says; compiling it again")
            return None
        return compiled

    def save(self, name: str, key: str, compiled: jax.stages.Compiled) -> bool:
        """Writes the program under `key`; False (logged once) where it cannot be serialized."""
        try:
            payload = _serialize(compiled)
        except Exception as error:  # noqa: BLE001: XLA refuses some programs (JaxRuntimeError); they stay compiled
            self.warn_once(f"the {name} program cannot be stored ({type(error).__name__}: {error})")
            return False
        header = json.dumps({"key": key, "program": name, "payload_bytes": len(payload),
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        self._write_scope()
        _write_whole(self._entry(name, key), MAGIC + _HEADER_LENGTH.pack(len(header)) + header + payload)
        return True

    def note_uncompiled(self, count: int) -> None:
        """Logs (once) that `count` programs came from JAX's persistent cache, so were not stored."""
        self._once(logging.INFO, f"{count} programs came from JAX's compilation cache and are not stored (a cached "
                   "program cannot be serialized whole again); name the store (--compiled DIR) or fill it with "
                   "`jaxserve compile --out DIR` to keep them all")

    def record_pool(self, pool: StoredPool) -> None:
        """Notes that every program of a pool of `pool.num_pages` pages is stored."""
        self._write_scope()
        _write_whole(self.folder / f"pool-{pool.num_pages}.json", json.dumps(dataclasses.asdict(pool)).encode())

    def stored_pools(self) -> list[StoredPool]:
        """The pool sizes whose programs were stored, largest first (unreadable records skipped)."""
        pools = []
        for path in self.folder.glob("pool-*.json"):
            try:
                pools.append(StoredPool(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return sorted(pools, key=lambda pool: -pool.num_pages)

    def _entry(self, name: str, key: str) -> Path:
        return self.folder / f"{name}-{key}{ENTRY_SUFFIX}"

    def _write_scope(self) -> None:
        path = self.folder / SCOPE_FILE
        if not path.is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_whole(path, json.dumps(self.scope.description, indent=2, sort_keys=True).encode())
            self._remove_superseded()

    def _remove_superseded(self) -> None:
        """Removes the scopes that differ from this new one in their sources alone, but the KEPT_BUILDS newest:
        programs of a source tree that changed, which no start of this tree can use (a rolling update still finds
        the build before it)."""
        superseded = []
        for path in self.root.glob(f"*/{SCOPE_FILE}"):
            try:
                other = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if path.parent != self.folder and scope_differences(self.scope.description, other) == ["sources"]:
                superseded.append(path)
        superseded.sort(key=lambda path: path.stat().st_mtime, reverse=True)
        for path in superseded[KEPT_BUILDS - 1:]:
            shutil.rmtree(path.parent, ignore_errors=True)
            self._once(logging.INFO, f"removed the stored programs of an earlier source tree: {path.parent}")

    def _explain_missing_scope(self) -> None:
        """Once: when the store holds programs of other scopes only, which parts of the key differ from the nearest."""
        if self.folder.is_dir() or not self.root.is_dir():
            return
        others = []
        for path in self.root.glob(f"*/{SCOPE_FILE}"):
            try:
                others.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        if others:
            nearest = min((scope_differences(self.scope.description, other) for other in others), key=len)
            self._once(logging.INFO, f"the program store {self.root} holds programs built for other settings "
                       f"({len(others)} scopes; the nearest differs in {', '.join(nearest)}): compiling, and storing "
                       "them")

    def warn_once(self, message: str) -> None:
        """Logs a warning once per store, however many programs it concerns."""
        self._once(logging.WARNING, message)

    def _once(self, level: int, message: str) -> None:
        with self._lock:
            if message in self._logged:
                return
            self._logged.add(message)
        log.log(level, "%s", message)


@contextlib.contextmanager
def compiling_afresh():
    """JAX's persistent compilation cache off for the block, process-wide: XLA compiles every program (and writes
    none to that cache), so that each can be stored whole."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once whether the cache is used; this asks again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


class EntryError(ValueError):
    """A stored program's file is not what its header promises: truncated, corrupt or another key's."""


def _read_entry(data: bytes, key: str, devices: list) -> jax.stages.Compiled:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HEADER_LENGTH.size:
        raise EntryError("not a stored program")
    start = len(MAGIC) + _HEADER_LENGTH.size
    (header_length,) = _HEADER_LENGTH.unpack(data[len(MAGIC):start])
    try:
        header = json.loads(data[start:start + header_length])
    except ValueError as error:
        raise EntryError("its header is unreadable") from error
    payload = data[start + header_length:]
    if header.get("key") != key:
        raise EntryError(f"stale: stored under key {header.get('key')}")
    if len(payload) != header.get("payload_bytes"):
        raise EntryError(f"truncated: {len(payload)} of {header.get('payload_bytes')} bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise EntryError("corrupt: its checksum does not match")
    executable, in_tree, out_tree = _DeviceUnpickler(io.BytesIO(payload), devices).load()
    return serialize_executable.deserialize_and_load(executable, in_tree, out_tree, backend=devices[0].client,
                                                     execution_devices=devices)


def _serialize(compiled: jax.stages.Compiled) -> bytes:
    executable, in_tree, out_tree = serialize_executable.serialize(compiled)
    with io.BytesIO() as file:
        _DevicePickler(file).dump((executable, in_tree, out_tree))
        return file.getvalue()


class _DevicePickler(pickle.Pickler):
    """Pickles devices (inside shardings and meshes of the tree structures) by id."""

    def persistent_id(self, obj):
        return ("device", obj.id) if isinstance(obj, jax.Device) else None


class _DeviceUnpickler(pickle.Unpickler):
    """Reads devices pickled by id back as this process's devices of those ids."""

    def __init__(self, file, devices: list):
        super().__init__(file)
        self._devices = {device.id: device for device in devices}

    def persistent_load(self, pid):
        kind, device_id = pid
        if kind != "device" or device_id not in self._devices:
            raise EntryError(f"it runs on device {device_id}, not among this runner's")
        return self._devices[device_id]


def _write_whole(path: Path, data: bytes) -> None:
    """Writes under a temporary name in the same folder, then renames: readers see the file whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
        file.write(data)
    os.chmod(file.name, 0o644)  # a store is shared: readable like any other file written here
    os.replace(file.name, path)
