"""Processes: one per device on this machine (`--processes N`), or this process joining a
cluster's (`--coordinator HOST:PORT --num-processes N --process-id I`, or `--distributed` for
JAX's own detection under SLURM, Open MPI or a TPU pod). Only `jax.distributed` and the
standard library's `subprocess`; no protocol of our own (docs/design.md §4, Time).

A launched worker is `python -m patchpar.lab.cli <the same command> --coordinator ...`, so it
takes exactly the cluster path. It pins itself to one core, runs XLA with one thread and one
CPU device, and joins the others over gloo. The launcher prefixes each worker's output with its
rank and ends every worker as soon as one fails, or when the timeout passes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

WORKER_ENV = "PATCHPAR_WORKER"  # "rank core": set by the launcher for each worker
LAYOUT_ENV = "PATCHPAR_LAYOUT"  # the launch's process/core layout (JSON), for the records
# (`intra_op_parallelism_threads=1`, here until 2026-12-01, is no XLA flag: XLA ignored it)
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"
CLUSTER_FLAGS = ("--coordinator", "--num-processes", "--process-id")


class WorkerFailed(RuntimeError):
    """A worker exited with an error, was killed, or outlived the timeout."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Cluster:
    """How this process joins others: explicit (coordinator, num_processes, process_id) or
    `auto` (JAX detects SLURM / Open MPI / TPU pods)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False


def cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def pop_cluster_flags(args: list[str]) -> tuple[list[str], Cluster | None]:
    """Take the cluster flags out of a command line: (the rest, how to join or None)."""
    rest, found, auto = [], {}, False
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if name in CLUSTER_FLAGS:
            if not eq:
                if i + 1 >= len(args):
                    raise ValueError(f"{name} needs a value")
                value, i = args[i + 1], i + 1
            found[name] = value
        elif a == "--distributed":
            auto = True
        else:
            rest.append(a)
        i += 1
    if not found and not auto:
        return rest, None
    if auto and found:
        raise ValueError("--distributed (auto-detection) and --coordinator/--num-processes/"
                         "--process-id are alternatives; give one")  # fmt: skip
    if auto:
        return rest, Cluster(auto=True)
    missing = [f for f in CLUSTER_FLAGS if f not in found]
    if missing:
        raise ValueError(f"joining a cluster needs all of {list(CLUSTER_FLAGS)}; missing {missing}")
    host, _, port = found["--coordinator"].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator={found['--coordinator']!r}: must be HOST:PORT")
    n, pid = _int("--num-processes", found["--num-processes"], 1), None
    pid = _int("--process-id", found["--process-id"], 0)
    if pid >= n:
        raise ValueError(f"--process-id={pid}: must be in [0, --num-processes={n})")
    return rest, Cluster(found["--coordinator"], n, pid)


def _int(flag: str, value: str, least: int) -> int:
    if not value.lstrip("-").isdigit() or int(value) < least:
        raise ValueError(f"{flag}={value!r}: must be an integer >= {least}")
    return int(value)


def setup_worker() -> None:
    """In a launched worker, before JAX starts: pin to its core, one XLA thread."""
    spec = os.environ.get(WORKER_ENV)
    if not spec:
        return
    _, core = (int(v) for v in spec.split())
    _exit_with_launcher()
    if core >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    # one CPU device: a device count inherited from the launcher's environment is dropped
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, ONE_THREAD])
    os.environ.pop("JAX_NUM_CPU_DEVICES", None)
    from patchpar.xla_flags import apply_defaults

    # one device per process: the single-device options, whatever the launcher had
    apply_defaults(1)


def _exit_with_launcher() -> None:
    """A worker whose launcher is gone (killed) exits instead of waiting forever."""
    launcher = os.getppid()

    def watch():
        while os.getppid() == launcher:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="patchpar-launcher-watch").start()


def in_worker() -> bool:
    """This process is one of several joined ones (launched here or on a cluster), or a
    launched single-process worker: it runs the command itself instead of launching."""
    import jax

    return bool(os.environ.get(WORKER_ENV)) or jax.process_count() > 1


def launched_worker() -> bool:
    """This process was started by `launch` (its launcher reports the result)."""
    return bool(os.environ.get(WORKER_ENV))


def is_writer() -> bool:
    """Process 0 of a multi-process run (or the only process) writes records, images, output."""
    spec = os.environ.get(WORKER_ENV)
    if spec:
        return spec.split()[0] == "0"
    import jax

    return jax.process_index() == 0


def join(cluster: Cluster) -> None:
    """jax.distributed.initialize with gloo collectives between CPU processes (GPUs use NCCL,
    TPUs their interconnect, whatever this says)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cluster.auto:
        jax.distributed.initialize()
        return
    host, _, port = cluster.coordinator.rpartition(":")
    if cluster.process_id == 0 and host in ("127.0.0.1", "localhost", socket.gethostname()):
        _check_free(host, int(port))
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator,
        num_processes=cluster.num_processes,
        process_id=cluster.process_id,
    )


def _check_free(host: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(
                f"--coordinator {host}:{port}: the port is in use ({e.strerror}); pick another "
                f"(e.g. {host}:{free_port()})"
            ) from None


def free_port() -> int:
    """A localhost port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layout(processes: int) -> dict:
    """Which core each of `processes` workers gets: one each while cores last, then shared."""
    have = cores() or list(range(os.cpu_count() or 1))
    return {
        "processes": processes,
        "cores": [have[i % len(have)] for i in range(processes)],
        "threads_per_process": 1,
        "cores_available": len(have),
        "oversubscribed": processes > len(have),
    }


def warn_oversubscribed(processes: int, log) -> None:
    have = len(cores() or range(os.cpu_count() or 1))
    if processes > have:
        log(
            f"warning: {processes} processes on {have} core(s): they share cores, so their "
            f"time is not a speedup (records say oversubscribed)"
        )


def launch(
    args: list[str],
    processes: int,
    timeout_s: float,
    log,
    env: dict | None = None,
    program: tuple[str, ...] = ("-m", "patchpar.lab.cli"),
) -> None:
    """Run `python <program> <args>` (by default `patchpar <args>`) as `processes` workers,
    each given the cluster flags to join the others (one worker: none, but pinned and
    single-threaded all the same), and wait for all of them. Raises WorkerFailed naming the
    rank when one fails or the timeout passes; the others are ended."""
    plan = layout(processes)
    warn_oversubscribed(processes, log)
    port = free_port()
    log(f"launching {processes} worker(s) on core(s) {plan['cores']}, one thread each"
        + (f", joined over gloo at 127.0.0.1:{port}" if processes > 1 else ""))  # fmt: skip
    procs, readers, tails = [], [], []
    for rank in range(processes):
        cmd = [sys.executable, *program, *args]
        if processes > 1:
            cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                    "--process-id", str(rank)]  # fmt: skip
        worker_env = {
            **os.environ,
            **(env or {}),
            WORKER_ENV: f"{rank} {plan['cores'][rank]}",
            LAYOUT_ENV: json.dumps(plan),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        p = subprocess.Popen(
            cmd, env=worker_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        tail: deque[str] = deque(maxlen=20)
        t = threading.Thread(target=_relay, args=(p, rank, tail), daemon=True)
        t.start()
        procs.append(p)
        readers.append(t)
        tails.append(tail)
    try:
        _wait(procs, tails, timeout_s)
    finally:
        _end(procs)
        for t in readers:
            t.join(timeout=5)


def _relay(p: subprocess.Popen, rank: int, tail: deque) -> None:
    for line in p.stdout:
        tail.append(line.rstrip("\n"))
        sys.stderr.write(f"[rank {rank}] {line}")
        sys.stderr.flush()


def _wait(procs, tails, timeout_s: float) -> None:
    start = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            _end(procs)  # at once: a survivor must not report the dead rank's absence as its own
            time.sleep(0.3)  # let the failing rank's last lines arrive
            rank, code = failed[0]
            why = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            last = next((ln for ln in reversed(tails[rank]) if ln.strip()), "")
            raise WorkerFailed(
                f"worker rank {rank} of {len(procs)} {why}" + (f": {last}" if last else ""),
                exit_code=2 if code == 2 else 1,
            )
        if all(c == 0 for c in codes):
            return
        if time.monotonic() - start > timeout_s:
            running = [r for r, c in enumerate(codes) if c is None]
            raise WorkerFailed(
                f"timeout: worker rank(s) {running} of {len(procs)} still running after "
                f"{timeout_s:.0f} s (a hung collective?); all ended"
            )
        time.sleep(0.1)


def _end(procs) -> None:
    """SIGKILL every worker still running (a joined JAX process takes SIGTERM as a preemption
    notice and carries on; records are appended whole, so killing loses no finished row)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()


def request_cpu_devices(n: int, log) -> None:
    """Before JAX starts its backend: if fewer than `n` CPU devices would be present, start
    it with `n` fake host devices (`--xla_force_host_platform_device_count`) and say so.
    Nothing happens in a launched worker, once the backend is running, or if the count is set."""
    import jax

    if n <= 1 or os.environ.get(WORKER_ENV) or "device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    if jax.config.jax_num_cpu_devices not in (-1, None) and jax.config.jax_num_cpu_devices >= n:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend is already running: make_mesh says what to do
        return
    from patchpar.xla_flags import apply_defaults

    apply_defaults(n)  # several devices in one process: the XLA:CPU options that keep them right
    log(
        f"patchpar: starting JAX with {n} CPU devices (as --xla_force_host_platform_device_count"
        f"={n}); they share this machine's cores, so their wall time is no speedup "
        f"(use --processes {n} for that)"
    )
