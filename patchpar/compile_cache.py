"""The persistent compilation cache: XLA executables kept on disk, so that a program compiled
once (a sweep point, `make run`, a launched worker) is read back instead of compiled again.

Where: `$PATCHPAR_HOME/compile-cache/<key>/` (PATCHPAR_HOME defaults to ~/.cache/patchpar), or
the folder in PATCHPAR_COMPILE_CACHE; `PATCHPAR_COMPILE_CACHE=off` (or the command-line flag
`--no-compile-cache`, which sets it for launched workers too) runs uncached. `<key>` is a hash of
everything a stored executable depends on beyond its program: patchpar's code (a hash of its
source files), the jax and jaxlib versions, XLA_FLAGS and the device kind. JAX's own entry key
adds the program itself (its StableHLO), the compile options and the device topology (device
and process count). Deleting the folder clears the cache; nothing else reads it.

Entries are written whole or not at all (a temporary file, then a rename), so two processes
filling the cache at once never leave half an entry; a corrupt or unreadable entry is skipped
with a warning naming it and compiled again, and the new executable replaces it. A folder that
cannot be written is a warning, and the run goes on uncached.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

ENV = "PATCHPAR_COMPILE_CACHE"
OFF = ("0", "off", "false", "no")

_state: dict = {"folder": None, "done": False, "hits": 0, "requests": 0}


def _warn(msg: str) -> None:
    print(f"patchpar: warning: {msg}", file=sys.stderr, flush=True)


def disabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in OFF


def root() -> Path:
    """The cache's root folder (the keyed folders are under it)."""
    given = os.environ.get(ENV, "").strip()
    if given and given.lower() not in OFF:
        return Path(given).expanduser()
    from patchpar.models.presets import home

    return home().expanduser() / "compile-cache"


def code_hash() -> str:
    """sha256 of patchpar's Python sources (names and contents): its code version, whether
    or not it is a git checkout, uncommitted changes included."""
    h = hashlib.sha256()
    pkg = Path(__file__).parent
    for path in sorted(pkg.rglob("*.py")):
        h.update(str(path.relative_to(pkg)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def key() -> dict:
    """What a cached executable depends on besides its program (JAX keys that)."""
    from importlib import metadata

    import jax

    dev = jax.devices()[0]
    return {
        "patchpar_code": code_hash(),
        "jax": metadata.version("jax"),
        "jaxlib": metadata.version("jaxlib"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "platform": dev.platform,
        "device_kind": dev.device_kind,
    }


def folder_for(k: dict) -> str:
    return hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:16]


def enable(where: Path | None = None, warn: Callable[[str], None] = _warn) -> Path | None:
    """Turn the cache on for this process (once; later calls return the same folder): JAX
    reads and writes executables in `<root>/<key>`. None (and a warning when the folder is the
    reason) where it stays off. Call it after the devices are set up (the key reads their
    kind) and before the first program worth keeping is compiled."""
    if _state["done"]:
        return _state["folder"]
    _state["done"] = True
    if disabled():
        return None
    k = key()
    folder = (Path(where) if where is not None else root()) / folder_for(k)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        warn(
            f"compile cache folder {str(folder)!r} cannot be written ({e.strerror or e}): "
            f"running uncached (set {ENV} to a writable folder, or {ENV}=off)"
        )
        return None
    meta = folder / "key.json"  # what the folder's name hashes, for a person looking at it
    if not meta.exists():
        _write_atomic(meta, json.dumps(k, indent=1, sort_keys=True).encode())
    _install(folder)
    _state["folder"] = folder
    return folder


def hits() -> int:
    """Executables this process has read from the cache so far."""
    return _state["hits"]


_COUNT_LOCK = threading.Lock()


def compiled() -> int:
    """Programs this process has compiled since the cache was on (not found in it, or not
    readable: each then written to it)."""
    return _state["requests"] - _state["hits"]


def _count(event: str, **kwargs) -> None:
    with _COUNT_LOCK:  # JAX reports from the thread that compiles (a run's phases: several)
        if event == "/jax/compilation_cache/cache_hits":
            _state["hits"] += 1
        elif event == "/jax/compilation_cache/compile_requests_use_cache":  # one per program
            _state["requests"] += 1


def _install(folder: Path) -> None:
    """Point JAX's persistent cache at `folder`, stored by `AtomicFileCache`."""
    import jax
    from jax._src import compilation_cache as cc

    jax.monitoring.register_event_listener(_count)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # every program, however quick to compile (a sweep is many small ones)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # XLA's own autotuning caches would put the folder's path into the key (a moved cache
    # would miss); XLA:CPU has none to keep
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    cc.reset_cache()
    with cc._cache_initialized_mutex:
        cc._cache = AtomicFileCache(folder)
        cc._cache_initialized = True
    if jax.process_index() != 0:
        _write_from_every_process()


def _write_from_every_process() -> None:
    """JAX writes entries from process 0 alone, but a program's key differs per process (its
    devices are part of it): the other processes of a launched run would compile every time.
    Each writes its own entries here (distinct keys: no two processes write one file)."""
    from jax._src import compilation_cache as cc
    from jax._src import compiler

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if host_callbacks:  # baked into the program: never cached (JAX's rule)
            return
        try:
            cc.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as e:
            _warn(f"compile cache entry for {module_name!r} not written ({type(e).__name__}: {e})")

    compiler._cache_write = write


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class AtomicFileCache:
    """JAX's cache interface (`get`, `put`) over one folder: an entry is `<key>-cache`, written to a temporary
    file and renamed into place (a reader sees the whole entry or none); an entry that does
    not decompress is skipped with a warning naming its file, and the recompiled executable
    replaces it (JAX's own file cache keeps the first file written under a key forever)."""

    SUFFIX = "-cache"

    def __init__(self, folder: Path, warn: Callable[[str], None] = _warn):
        self._path = Path(folder)
        self.warn = warn

    def _file(self, key: str) -> Path:
        if not key:
            raise ValueError("compile cache: empty key")
        return self._path / f"{key}{self.SUFFIX}"

    def get(self, key: str) -> bytes | None:
        from jax._src.compilation_cache import decompress_executable

        path = self._file(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            self.warn(f"compile cache entry {str(path)!r} cannot be read ({e}): compiling again")
            return None
        try:
            decompress_executable(data)
        except Exception as e:
            self.warn(
                f"compile cache entry {str(path)!r} is corrupt ({type(e).__name__}: {e}): "
                f"skipped, compiling again (the new executable replaces it)"
            )
            return None
        return data

    def put(self, key: str, value: bytes) -> None:
        try:
            _write_atomic(self._file(key), value)
        except OSError as e:
            self.warn(f"compile cache entry for {key[:24]}... not written ({e}); running on")

    def clear(self) -> None:
        for path in self._path.glob(f"*{self.SUFFIX}"):
            with contextlib.suppress(OSError):
                path.unlink()
