"""Seconds per collective over jax.distributed on this machine (gloo on CPU): the kinds a
patch-parallel step issues (collective-permute = halo rows, all-gather = K/V, all-reduce =
GroupNorm statistics), at operand sizes from a few bytes to megabytes, between launched
processes with one core and one thread each (as `--processes`).

    .venv/bin/python experiments/bench_collectives.py                 # 2 processes
    .venv/bin/python experiments/bench_collectives.py --processes 2 --out runs/speedup_cpu

Each point times a compiled loop of `--chain` collectives, each fed by the one before it (so
none can be dropped or overlapped), median of `--repeats` calls, divided by the chain length.
A record per (kind, operand bytes) goes to <out>/collectives.jsonl, and the fit
seconds = latency + bytes / bandwidth per kind (least squares) to <out>/collectives_fit.json;
experiments/speedup_breakdown.py uses the fit to price each run's collectives.
With `--compute-ms T` each collective of the chain follows T ms of compute (a matmul on the
collective's input, as in a model step) and the same chain without the collectives is timed
too: the difference per collective is its cost when it comes after compute (the processes
meet again, gloo's thread wakes up), fitted the same way into "fit_after_compute".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

KINDS = ("collective-permute", "all-gather", "all-reduce")
SIZES = (64, 1024, 16 * 1024, 128 * 1024, 1024**2, 4 * 1024**2)  # operand bytes per device


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--chain", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("runs/speedup_cpu"))
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument(
        "--compute-ms", type=float, default=0.0,
        help="also time each collective after this much compute (0: only the bare chain)",
    )  # fmt: skip
    return p.parse_args(argv)


def program(kind: str, elems: int, chain: int, mesh, work: int = 0):
    """jit(x (n * elems,) f32 sharded) -> x after `chain` dependent collectives of `kind`
    (kind None: none), each after a (work, work) matmul fed by the collective's input."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size

    def one(x):  # (elems,) per device -> (elems,)
        if kind is None:
            return x
        if kind == "collective-permute":
            return lax.ppermute(x, "d", [(i, (i + 1) % n) for i in range(n)])
        if kind == "all-gather":
            return lax.all_gather(x, "d", tiled=True)[:elems] * 0.5
        return lax.psum(x, "d") * (1.0 / n)

    def compute(v):
        if not work:
            return v
        m = jnp.full((work, work), 1e-3, jnp.float32) + v[0]
        return v + 1e-9 * (m @ m)[0, 0]

    def body(x):
        return lax.fori_loop(0, chain, lambda _, v: one(compute(v)) + 1.0, x)

    f = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False)
    return jax.jit(f), jnp.zeros((n * elems,), jnp.float32)


def worker(args) -> None:
    import jax
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from patchpar.lab.results import append_record, provenance

    mesh = Mesh(jax.devices(), ("d",), axis_types=(AxisType.Auto,))

    def per_link(kind, elems, work):
        fn, x = program(kind, elems, args.chain, mesh, work)
        x = jax.device_put(x, NamedSharding(mesh, P("d")))
        jax.block_until_ready(fn(x))  # compile and warm up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / args.chain

    work = _matmul_size(args.compute_ms, per_link) if args.compute_ms else 0
    rows = []
    for kind in KINDS:
        for size in args.sizes:
            elems = max(1, size // 4)
            per = per_link(kind, elems, 0)
            row = {"kind": kind, "operand_bytes": elems * 4, "seconds": per}
            if work:  # the same link after compute, less the compute alone
                row["after_compute_s"] = per_link(kind, elems, work) - per_link(None, elems, work)
                row["compute_matmul"] = work
            rows.append(row)
            if jax.process_index() == 0:
                after = f"  after compute {row['after_compute_s'] * 1e6:9.1f} us" if work else ""
                print(f"{kind:18s} {elems * 4:>9d} B  {per * 1e6:9.1f} us{after}", flush=True)
    if jax.process_index() != 0:
        return
    layout = json.loads(__import__("os").environ.get("PATCHPAR_LAYOUT", "null"))
    prov = provenance()
    for r in rows:
        append_record(
            args.out / "collectives.jsonl",
            {**r, "processes": jax.process_count(), "chain": args.chain,
             "repeats": args.repeats, "layout": layout, "provenance": prov},
        )  # fmt: skip
    fit = fit_rows(rows)
    out = {"processes": jax.process_count(), "fit": fit}
    if work:
        out["compute_ms"] = args.compute_ms
        out["fit_after_compute"] = fit_rows(rows, "after_compute_s")
    tmp = args.out / "collectives_fit.json.tmp"
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(args.out / "collectives_fit.json")
    for kind, f in fit.items():
        print(
            f"{kind:18s} latency {f['latency_s'] * 1e6:7.1f} us, {f['bytes_per_s'] / 1e9:.2f} GB/s"
        )


def _matmul_size(ms: float, per_link) -> int:
    """The square matmul that takes about `ms` milliseconds on this device (grown from 64)."""
    work = 64
    while per_link(None, 1, work) < ms / 1e3 and work < 8192:
        work = int(work * 1.26)
    return work


def fit_rows(rows: list[dict], key: str = "seconds") -> dict:
    """key (seconds) = latency + bytes / bandwidth per kind, least squares."""
    import numpy as np

    out = {}
    for kind in KINDS:
        pts = [(r["operand_bytes"], r[key]) for r in rows if r["kind"] == kind]
        if len(pts) < 2:
            continue
        b, s = np.array(pts, float).T
        slope, latency = np.polyfit(b, s, 1)
        # a size-independent time (slope <= 0: too few or too small sizes) has no bandwidth term
        out[kind] = {
            "latency_s": float(max(latency, 0.0)),
            "bytes_per_s": float(1 / slope) if slope > 0 else None,
        }
    return out


def main(argv=None) -> int:
    from patchpar.lab import launch

    launch.setup_worker()
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, cluster = launch.pop_cluster_flags(argv)
    args = parse(argv)
    if cluster is not None:
        launch.join(cluster)
        worker(args)
        return 0
    if args.processes < 2:
        raise SystemExit(f"--processes={args.processes}: a collective needs >= 2 processes")
    args.out.mkdir(parents=True, exist_ok=True)
    launch.launch(argv, args.processes, args.timeout_s, print, program=(__file__,))
    return 0


if __name__ == "__main__":
    sys.exit(main())
