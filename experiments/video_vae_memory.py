"""Memory per device of Wan 2.1's video VAE decode (its decoder, bf16 and float32, abstract
weights) for one video at 480p and 720p x 81 frames (21 latent frames) on 1, 2, 4 and 8 fake
CPU devices: the one-device decode and every frame's rows split over the devices
(`parallel.vae.decode_video`, exact). XLA's buffer assignment per device of the compiled
program (arguments, outputs, temporaries).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python experiments/video_vae_memory.py --out results/video_vae_memory

Records: <out>/runs.jsonl (resumable: points already recorded are skipped); table: <out>/table.md.
The decode runs one latent frame at a time (a scan carrying the causal caches), so the
temporaries are one chunk's activations at full frame size (4 output frames), whatever the
frame count; the output (81 frames x H x W x 3) is most of the rest.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 2**30
SIZES = {"480p": (480, 832), "720p": (720, 1280)}
FRAMES = 81
DEVICES = (1, 2, 4, 8)
DTYPES = ("bfloat16", "float32")
MODEL = "wan2.1-1.3b"  # the VAE of every Wan 2.1 model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "video_vae_memory")
    p.add_argument("--table-only", action="store_true")
    a = p.parse_args(argv)
    from patchpar.lab.results import read_records

    runs = a.out / "runs.jsonl"
    if not a.table_only:
        run(runs)
    write_table(read_records(runs, skip_bad=True), a.out / "table.md")
    return 0


def run(runs: Path) -> None:
    import jax.numpy as jnp
    from tqdm import tqdm

    from patchpar.lab.results import append_record, provenance, read_records
    from patchpar.measure.cost import memory_per_device
    from patchpar.models.presets import PRESETS
    from patchpar.models.video import latent_frames
    from patchpar.models.wan import WanVAEFn
    from patchpar.models.wan.vae import WanVAEConfig, WanVAEDecoder
    from patchpar.parallel.vae import VAEPlan, lowered_decode_video

    done = {(r["size"], r["devices"], r["dtype"]) for r in read_records(runs, skip_bad=True)}
    prov = provenance()
    cfg = WanVAEConfig.from_diffusers(PRESETS[MODEL]["vae"])
    points = [(s, n, d) for d in DTYPES for s in SIZES for n in DEVICES]
    for size, n, dtype in tqdm(points, desc="video VAE memory", unit="point"):
        if (size, n, dtype) in done:
            continue
        fn = WanVAEFn(WanVAEDecoder(cfg, getattr(jnp, dtype)))
        h, w = (v // cfg.spatial_factor for v in SIZES[size])
        shape = (1, latent_frames(FRAMES, cfg.temporal_factor), h, w, cfg.z_dim)
        plan = VAEPlan("rows" if n > 1 else "off", n)
        rec = {"experiment": "video_vae_memory", "model": MODEL, "size": size, "frames": FRAMES,
               "devices": n, "mode": plan.mode, "dtype": dtype, "latent_shape": list(shape)}  # fmt: skip
        t0 = time.perf_counter()
        try:
            compiled = lowered_decode_video(fn, fn.abstract_params(), shape, plan).compile()
            rec.update(status="ok", memory=memory_per_device(compiled))
        except Exception as e:  # noqa: BLE001 - a failed point is a row with its error
            rec.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        append_record(runs, {**rec, "provenance": prov})


def write_table(records: list[dict], path: Path) -> None:
    lines = [
        f"Wan 2.1's VAE decode of one {FRAMES}-frame video, memory per device (GiB, XLA's buffer "
        "assignment on CPU; abstract weights)",
        "",
        "| size | dtype | devices | mode | total | arguments | outputs | temporaries | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        m = r.get("memory") or {}

        def g(k, m=m):
            return "-" if m.get(k) is None else f"{m[k] / GIB:.2f}"

        lines.append(
            f"| {r['size']} | {r['dtype']} | {r['devices']} | {r['mode']} | {g('total')} | "
            f"{g('arguments')} | {g('outputs')} | {g('temporaries')} | "
            f"{r['status'] if r['status'] == 'ok' else r.get('error', '')[:60]} |"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
