"""The persistent compilation cache (`patchpar.compile_cache`): entries written whole, a corrupt
entry skipped with a warning naming it and then replaced, an unwritable folder a warning and an
uncached run, and a program compiled in one process read back in another."""

import json
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from patchpar.compile_cache import ENV, AtomicFileCache, folder_for, root


def test_entry_roundtrip_and_corrupt_entry_replaced(tmp_path):
    said = []
    cache = AtomicFileCache(tmp_path, warn=said.append)
    value = zlib.compress(b"executable" * 100)
    assert cache.get("k1") is None
    cache.put("k1", value)
    assert cache.get("k1") == value
    (tmp_path / "k1-cache").write_bytes(b"half an entr")  # as a crashed non-atomic writer leaves
    assert cache.get("k1") is None
    assert len(said) == 1 and "k1-cache" in said[0] and "corrupt" in said[0], said
    cache.put("k1", value)  # the recompiled executable replaces it
    assert cache.get("k1") == value and len(said) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["k1-cache"]  # no temporary file left


def test_concurrent_fill_never_shows_half_an_entry(tmp_path):
    """Writers put large entries under one key while a reader reads: every read is absent or
    a whole entry (JAX's own file cache writes in place, so a reader can see a prefix)."""
    said = []
    cache = AtomicFileCache(tmp_path, warn=said.append)
    rng = np.random.default_rng(0)
    values = [zlib.compress(rng.bytes(4 << 20), 1) for _ in range(2)]
    stop, seen = threading.Event(), []

    def write(v):
        for _ in range(15):
            cache.put("k", v)

    def read():
        while not stop.is_set():
            got = cache.get("k")
            if got is not None:
                seen.append(got in values)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(v,)) for v in values]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert seen and all(seen) and not said, (len(seen), said)
    assert cache.get("k") in values


def test_folder_is_keyed_and_rooted(monkeypatch, tmp_path):
    monkeypatch.setenv("PATCHPAR_HOME", str(tmp_path))
    monkeypatch.delenv(ENV, raising=False)
    assert root() == tmp_path / "compile-cache"
    monkeypatch.setenv(ENV, str(tmp_path / "elsewhere"))
    assert root() == tmp_path / "elsewhere"
    k = {"patchpar_code": "a", "jax": "1", "jaxlib": "1", "xla_flags": "", "device_kind": "cpu"}
    assert folder_for(k) == folder_for(dict(reversed(k.items())))  # order does not matter
    for field in k:  # each part of the key changes the folder
        assert folder_for({**k, field: "other"}) != folder_for(k)


_SCRIPT = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp
from patchpar import compile_cache
said = []
folder = compile_cache.enable(Path(sys.argv[1]), warn=said.append)
f = jax.jit(lambda x: jnp.tanh(x) @ x.T + 2.0)
y = f(jnp.arange(64.0).reshape(8, 8) / 64)
print(json.dumps({"folder": str(folder) if folder else None, "hits": compile_cache.hits(),
                  "compiled": compile_cache.compiled(), "said": said, "y": float(y.sum()),
                  "dir": jax.config.jax_compilation_cache_dir}))
"""


def _child(where, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update(env_extra or {})
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(where)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_reads_what_the_first_compiled(tmp_path):
    first = _child(tmp_path)
    assert first["folder"] and first["hits"] == 0 and first["compiled"] >= 1 and not first["said"]
    entries = sorted(p.name for p in Path(first["folder"]).glob("*-cache"))
    assert any(name.startswith("jit__lambda") for name in entries), entries
    assert json.loads((Path(first["folder"]) / "key.json").read_text())["jaxlib"]
    second = _child(tmp_path)
    assert second["folder"] == first["folder"] and second["hits"] >= 1
    assert second["compiled"] == 0 and second["hits"] == first["compiled"]  # all read back
    assert second["y"] == first["y"]  # the same program, read back
    # an entry whose executable does not load (valid zlib, not an executable): JAX warns and
    # compiles; the new executable replaces it
    lam = next(Path(first["folder"]).glob("jit__lambda*-cache"))
    lam.write_bytes(zlib.compress(b"not an executable"))
    third = _child(tmp_path)
    assert third["y"] == first["y"]
    assert _child(tmp_path)["hits"] == second["hits"]  # repaired: read back again


def test_unwritable_folder_runs_uncached(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    got = _child(blocker)
    assert got["folder"] is None and got["dir"] is None and got["y"] == _child(tmp_path)["y"]
    assert len(got["said"]) == 1 and "cannot be written" in got["said"][0]
    assert "running uncached" in got["said"][0] and str(blocker) in got["said"][0]


def test_off_runs_uncached(tmp_path):
    got = _child(tmp_path, {ENV: "off"})
    assert got["folder"] is None and got["dir"] is None and not got["said"]
    assert not list(tmp_path.iterdir())


def test_cli_flag_turns_it_off_for_workers_too(monkeypatch):
    from patchpar.lab import cli

    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(SystemExit):
        cli.main(["--no-compile-cache", "--help"])
    assert os.environ[ENV] == "off"  # inherited by launched workers


_MP_SCRIPT = """
import sys
import jax, jax.numpy as jnp
from pathlib import Path
jax.distributed.initialize(sys.argv[3], 2, int(sys.argv[1]))
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from patchpar import compile_cache
compile_cache.enable(Path(sys.argv[2]))
mesh = Mesh(jax.devices(), ("x",))
a = jax.make_array_from_callback((8, 8), NamedSharding(mesh, P("x")), lambda i: jnp.ones((8, 8))[i])
f = jax.jit(lambda a: jnp.tanh(a) @ a.T, out_shardings=NamedSharding(mesh, P()))
f(a).block_until_ready()
print("hits", compile_cache.hits())
"""


def _two_processes(where) -> list[int]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "XLA_FLAGS")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _MP_SCRIPT, str(rank), str(where), f"127.0.0.1:{port}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, out[-2000:]
        outs.append(int(out.strip().splitlines()[-1].split()[1]))
    return outs


@pytest.mark.slow
def test_every_process_of_a_launched_run_reads_back_its_programs(tmp_path):
    """A program's key differs per process (its devices are in it) and JAX writes from process
    0 alone: without each process writing its own entries, process 1 compiled every time."""
    assert _two_processes(tmp_path) == [0, 0]
    assert all(h >= 1 for h in _two_processes(tmp_path))


@pytest.mark.slow
def test_a_second_run_reads_its_programs_back(tmp_path, micro_folder):
    """`patchpar run` twice on one point (DistriFusion: two phase programs), each a fresh
    process: the second reads its programs from the cache, records how many, and gives the
    same images bit for bit (the same program). Only what the cache serves is measured: no
    quality baseline (a single-device run to compile) and no byte count (more programs)."""
    import yaml

    from patchpar.lab.results import read_records

    cfg = {
        "experiment": "cached",
        "model": {"name": str(micro_folder)},
        "sampler": {"steps": 3, "height": 32, "width": 32, "guidance_scale": 5.0},
        "prompts": {"prompts": ["a red bag"], "seeds": [0]},
        "strategy": {"name": "distrifusion", "warmup_steps": 0},
        "mesh": {"devices": 2},
        "measure": {"warmup_runs": 0, "repeats": 1, "quality": [], "comm": False},
        "results": str(tmp_path / "results"),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PATCHPAR_HOME"] = str(tmp_path / "home")
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-m", "patchpar.lab.cli", "run", str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
    first, second = read_records(tmp_path / "results" / "cached" / "runs.jsonl")
    assert first["metrics"]["compile_cache_hits"] == 0
    assert second["metrics"]["compile_cache_hits"] >= 2  # both phase programs
    assert "read from the compile cache" in out.stderr
    assert first["images"] and second["images"] != first["images"]  # each run its own files
    folder = tmp_path / "results" / "cached"  # image paths are the experiment folder's
    for a, b in zip(first["images"], second["images"], strict=True):
        assert (folder / a).read_bytes() == (folder / b).read_bytes()
    assert list((tmp_path / "home" / "compile-cache").iterdir())


def test_compile_profile_counts_a_programs_instructions_by_opcode():
    """experiments/compile_profile.py's opcode counts of a compiled program's HLO text: every
    computation's instructions (a fused computation's too), ROOT ones included, as many in
    all as `hlo_instructions` counts; on a real program, its own text."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
    from compile_profile import hlo_instructions, hlo_opcodes

    text = """HloModule m

%fused (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(f32[4]{0} %p0)
}

ENTRY %main (a: f32[4], b: f32[4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %add.1 = f32[4]{0} add(f32[4]{0} %a, f32[4]{0} %b)
  %fusion = f32[4]{0} fusion(f32[4]{0} %add.1), kind=kLoop, calls=%fused
  ROOT %tuple = (f32[4]{0}, f32[4]{0}) tuple(f32[4]{0} %add.1, f32[4]{0} %fusion)
}
"""
    assert hlo_opcodes(text) == {"parameter": 3, "negate": 1, "add": 1, "fusion": 1, "tuple": 1}
    compiled = jax.jit(lambda x: jnp.sin(x) @ x.T + 1).lower(jnp.ones((8, 8))).compile()
    real = compiled.as_text()
    ops = hlo_opcodes(real)
    assert ops.get("parameter", 0) >= 1 and sum(ops.values()) == hlo_instructions(real)
