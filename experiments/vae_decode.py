"""The SDXL VAE decode on several devices: memory per device from the compiled programs (fake
devices) and time over launched processes (one core each), for the one-device decode (`off`),
patch-parallel rows (exact) and distributed tiles (diffusers' tiling rule, not exact).

    .venv/bin/python experiments/vae_decode.py memory                  # -> runs/vae/memory.jsonl
    .venv/bin/python experiments/vae_decode.py time                    # -> runs/vae/time.jsonl
    .venv/bin/python experiments/vae_decode.py memory time --out results/vae

memory: SDXL's VAE config (float32, as SDXL's `force_upcast` runs it; abstract weights, the
chunked attention kernel) lowered for one 1024/2048/3840-pixel image on 1/2/4/8 fake CPU devices
and compiled; XLA's buffer assignment per device (arguments, outputs, temporaries), and the
bytes each device receives from the pre-optimisation HLO. Points already recorded are skipped.
tiles: the VAE's own tile (sample_size 1024 px) where the image is larger, else 512 px.

time: random SDXL VAE weights (seed 0), one image at 512 and 1024 pixels; `off` in one launched
process, `rows` and `tiles` (tile = half the image) in two, each pinned to its own core with one
thread (patchpar.lab.launch), so the ratio is a measured speedup on this CPU. The first call
(compilation) is timed apart; then `--repeats` timed calls; median. Tiles also get their PSNR
against the exact decode (random weights: a measure of the seams, not of a trained VAE's).

Tables: <out>/memory.md and <out>/time.md, from the records.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 2**30
SIZES = (1024, 2048, 3840)
DEVICES = (1, 2, 4, 8)
TIME_SIZES = (512, 1024)
TIME_POINTS = (("off", 1), ("rows", 2), ("tiles", 2))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="+", choices=("memory", "time"))
    p.add_argument("--out", type=Path, default=REPO / "runs" / "vae")
    p.add_argument("--sizes", type=int, nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def sdxl_vae(dtype="float32"):
    import jax.numpy as jnp

    from patchpar.models.api import VAEFn
    from patchpar.models.attention import AttentionSpec
    from patchpar.models.presets import PRESETS
    from patchpar.models.vae import AutoencoderKL, VAEConfig

    cfg = VAEConfig.from_diffusers(PRESETS["sdxl"]["vae"])
    return VAEFn(AutoencoderKL(cfg, getattr(jnp, dtype), attn=AttentionSpec("chunked")))


def memory(out: Path, sizes) -> None:
    from patchpar.lab.launch import request_cpu_devices

    request_cpu_devices(max(DEVICES), print)
    from patchpar.lab.results import append_record, provenance, read_records
    from patchpar.measure.comm import count_hlo, hlo_text_with_metadata
    from patchpar.measure.cost import memory_per_device
    from patchpar.parallel.vae import VAEPlan, lowered_decode, tile_count

    path = out / "memory.jsonl"
    done = {_mkey(r) for r in (read_records(path) if path.is_file() else [])}
    vae = sdxl_vae()
    params = vae.abstract_params()
    prov = provenance()
    points = [(s, m, n) for s in sizes for m in ("off", "rows", "tiles") for n in DEVICES
              if (m == "off") == (n == 1) or m == "tiles"]  # fmt: skip
    for size, mode, n in points:
        if _mkey({"size": size, "mode": mode, "devices": n}) in done:
            continue
        tile = 1024 if size > 1024 else 512
        plan = VAEPlan(mode, n, tile=tile if mode == "tiles" else 0)
        z = (1, size // 8, size // 8, 4)
        t0 = time.perf_counter()
        low = lowered_decode(vae, params, z, plan)
        compiled = low.compile()
        mem = memory_per_device(compiled)
        # rows: the sites' collectives (pre-optimisation HLO); tiles: what the partitioner
        # inserts to gather the decoded tiles (compiled HLO, float32 here, so exact)
        text = hlo_text_with_metadata(low) if mode == "rows" else compiled.as_text()
        hlo = count_hlo(text, n).summary() if n > 1 else {}
        row = {
            "size": size, "mode": mode, "devices": n, "tile": plan.tile or None,
            "tiles": tile_count(z[1:3], tile, 8) if mode == "tiles" else None,
            "dtype": "float32", "attention": "chunked", "memory_per_device": mem,
            "received_bytes_per_device": hlo.get("all", {}).get("max", 0),
            "received_by_site": {k: v["max"] for k, v in hlo.items() if k != "all"},
            "compile_s": round(time.perf_counter() - t0, 1),
            "command": "python experiments/vae_decode.py memory", **prov,
        }  # fmt: skip
        append_record(path, row)
        print(f"{size}px {mode:5s} {n} dev: {mem['total'] / GIB:7.2f} GiB per device "
              f"({row['compile_s']} s)", flush=True)  # fmt: skip
    (out / "memory.md").write_text(memory_table(read_records(path)))


def _mkey(r: dict) -> tuple:
    return (r["size"], r["mode"], r["devices"])


def memory_table(records: list[dict]) -> str:
    single = {r["size"]: r["memory_per_device"]["total"] for r in records if r["mode"] == "off"}
    lines = [
        "SDXL VAE decode, one image, float32, chunked attention: memory per device (XLA's buffer "
        "assignment of the compiled program, GiB) and its share of the one-device decode's; "
        "bytes each device receives (HLO).",
        "",
        "| size | mode | devices | GiB per device | of one device | temporaries GiB | received MiB "
        "| commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(
        records, key=lambda r: (r["size"], r["mode"] != "off", r["mode"], r["devices"])
    ):
        m = r["memory_per_device"]
        share = m["total"] / single[r["size"]] if r["size"] in single else float("nan")
        mode = r["mode"] if r["mode"] != "tiles" else f"tiles {r['tile']} px ({r['tiles']})"
        lines.append(
            f"| {r['size']} | {mode} | {r['devices']} | {m['total'] / GIB:.2f} | {share:.3f} | "
            f"{m['temporaries'] / GIB:.2f} | {r['received_bytes_per_device'] / 2**20:.1f} | "
            f"{_commit(r)} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ time


def timing(out: Path, sizes, repeats: int) -> None:
    from patchpar.lab import launch
    from patchpar.lab.results import read_records

    path = out / "time.jsonl"
    done = {(r["size"], r["mode"], r["processes"]) for r in (read_records(path) if path.is_file() else [])}  # fmt: skip
    for size in sizes:
        for mode, processes in TIME_POINTS:
            if (size, mode, processes) in done:
                continue
            args = ["--worker", str(path), str(size), mode, str(repeats)]
            launch.launch(args, processes, 3600, print, program=(str(Path(__file__).resolve()),))
    (out / "time.md").write_text(time_table(read_records(path)))


def worker(argv: list[str]) -> None:
    """One launched process: decode `size` as `mode` over every process's device, time it."""
    from patchpar.lab import launch

    launch.setup_worker()
    args, cluster = launch.pop_cluster_flags(argv)
    import jax

    if cluster is not None:
        launch.join(cluster)
    import numpy as np

    from patchpar.lab.results import append_record, provenance
    from patchpar.measure.quality import psnr_per_image
    from patchpar.parallel.mesh import to_local
    from patchpar.parallel.vae import VAEPlan, decode

    path, size, mode, repeats = Path(args[0]), int(args[1]), args[2], int(args[3])
    n = jax.device_count()
    vae = sdxl_vae()
    params = vae.init(0)
    z = jax.random.normal(jax.random.key(0), (1, size // 8, size // 8, 4))
    plan = VAEPlan(mode, n, tile=size // 2 if mode == "tiles" else 0)

    def call():
        return np.asarray(to_local(decode(vae, params, z, plan)))

    t0 = time.perf_counter()
    img = call()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        img = call()
        times.append(time.perf_counter() - t0)
    quality = None
    if mode == "tiles":  # against the exact decode, on this process's device alone
        exact = np.asarray(decode(vae, params, z, VAEPlan()))
        quality = float(np.mean(psnr_per_image(_uint8(img), _uint8(exact))))
    if jax.process_index() == 0:
        append_record(path, {
            "size": size, "mode": mode, "processes": n, "tile": plan.tile or None,
            "decode_s_first": first, "decode_s_median": statistics.median(times),
            "decode_s_all": [round(t, 4) for t in times], "psnr_vs_exact": quality,
            "layout": launch.layout(n), "dtype": "float32", "attention": "chunked",
            "command": "python experiments/vae_decode.py time", **provenance(),
        })  # fmt: skip
        print(f"{size}px {mode} on {n} process(es): {statistics.median(times):.2f} s", flush=True)


def _uint8(img):
    """[-1, 1] -> uint8, as the pipeline post-processes."""
    import numpy as np

    return np.round(np.clip(np.asarray(img, np.float32) / 2 + 0.5, 0, 1) * 255).astype(np.uint8)


def time_table(records: list[dict]) -> str:
    one = {r["size"]: r["decode_s_median"] for r in records if r["mode"] == "off"}
    lines = [
        "SDXL VAE decode, one image, float32, random weights: seconds on this CPU, each process "
        "one core and one thread (median of the timed calls; compilation apart).",
        "",
        "| size | mode | processes | decode s | speedup vs one process | PSNR vs exact dB | "
        "first call s | commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(records, key=lambda r: (r["size"], r["processes"], r["mode"])):
        sp = one[r["size"]] / r["decode_s_median"] if r["size"] in one else float("nan")
        q = "exact" if r["mode"] != "tiles" else f"{r['psnr_vs_exact']:.2f}"
        mode = r["mode"] if r["mode"] != "tiles" else f"tiles {r['tile']} px"
        lines.append(
            f"| {r['size']} | {mode} | {r['processes']} | {r['decode_s_median']:.2f} | "
            f"{sp:.2f}x | {q} | {r['decode_s_first']:.1f} | {_commit(r)} |"
        )
    return "\n".join(lines) + "\n"


def _commit(r: dict) -> str:
    return f"{r['git_commit'][:7]}{'-dirty' if r['git_dirty'] else ''}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(argv[1:])
        return 0
    a = parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if "memory" in a.what:
        memory(a.out, a.sizes or SIZES)
    if "time" in a.what:
        timing(a.out, a.sizes or TIME_SIZES, a.repeats)
    print(f"-> {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(REPO))
    sys.exit(main())
