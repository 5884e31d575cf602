"""The quality-vs-bytes frontier of compressed and extrapolated exchange, from the records of
experiments/sweeps/compress_fmnist.yaml and compress_fmnist_dit.yaml (records only: nothing is
run here). Per folder: <folder>/plots/frontier.png (PSNR against single and prompt accuracy
against bytes per image, log scale) and <folder>/frontier.md (every point by bytes, and the
two targets: a stale compressed point with <= 2% of DistriFusion's steady bytes within 1 dB of
its PSNR; a fresh one with <= 15% of DistriFusion's bytes per image and PSNR >= its).

    .venv/bin/python experiments/compress_frontier.py results/compress_fmnist results/compress_fmnist_dit
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STALE_BYTES, STALE_DB = 0.02, 1.0  # the stale target: steady bytes share, PSNR within
FRESH_BYTES = 0.15  # the fresh target: bytes per image share, PSNR at least DistriFusion's


def family(row) -> str:
    """Which series a record belongs to."""
    name = row["config.strategy.name"]
    codec = row.get("config.strategy.codec")
    compressed = isinstance(codec, str) and codec not in ("none", "")
    if name == "compact":
        return "compact (fresh, compressed)"
    if (row.get("config.strategy.extrapolate") or 0) > 0:
        return f"{name} extrapolated" + (" + compressed" if compressed else "")
    if compressed:
        return f"{name} stale, compressed"
    return name


def frame(folder: Path):
    from patchpar.lab import load_records

    df = load_records(folder, latest=True, ok_only=True)
    df = df[df["config.strategy.name"] != "single"].copy()
    df["family"] = [family(r) for _, r in df.iterrows()]
    df["bytes_per_image"] = df["metrics.bytes_per_device_total"] / df["metrics.batch"]
    df["steady_bytes_per_image"] = df["metrics.steady_bytes_per_device"] / df["metrics.batch"]
    return df.sort_values("bytes_per_image")


def targets(df) -> list[str]:
    """The two targets against DistriFusion at its default warm-up (the sweep's `distrifusion`)."""
    ref = df[df["label"] == "distrifusion"].iloc[0]
    ref_psnr, ref_steady = ref["metrics.psnr"], ref["metrics.steady_bytes_per_device"]
    ref_total = ref["metrics.bytes_per_device_total"]
    out = [
        f"DistriFusion (default warm-up): PSNR {ref_psnr:.2f} dB, steady "
        f"{ref_steady / 2**20:.2f} MiB/device/step, {ref_total / ref['metrics.batch'] / 2**20:.2f} "
        "MiB/device per image.",
    ]
    same_warmup = df["config.strategy.warmup_steps"].isna() | (
        df["config.strategy.warmup_steps"] == ref["config.strategy.warmup_steps"]
    )
    compressed = df["family"].str.contains("compressed") & ~df["family"].str.startswith("compact")
    stale = df[compressed & same_warmup].copy()  # extrapolated ones too
    stale["share"] = stale["metrics.steady_bytes_per_device"] / ref_steady
    stale["gap"] = ref_psnr - stale["metrics.psnr"]
    hit = stale[(stale["share"] <= STALE_BYTES) & (stale["gap"] <= STALE_DB)]
    out.append(
        _verdict(
            "stale",
            hit,
            stale,
            "share",
            f"<= {STALE_BYTES:.0%} steady bytes, within {STALE_DB:g} dB",
        )
    )
    fresh = df[df["family"].str.startswith("compact")].copy()
    fresh["share"] = fresh["metrics.bytes_per_device_total"] / ref_total
    fresh["gap"] = ref_psnr - fresh["metrics.psnr"]
    hit = fresh[(fresh["share"] <= FRESH_BYTES) & (fresh["gap"] <= 0)]
    out.append(
        _verdict(
            "fresh",
            hit,
            fresh,
            "share",
            f"<= {FRESH_BYTES:.0%} bytes per image, PSNR >= DistriFusion's",
        )
    )
    return out


def _verdict(what, hit, pool, share, rule) -> str:
    if len(hit):
        best = hit.sort_values(share).iloc[0]
        return (
            f"{what} target ({rule}): **met** by `{best['label']}`: {best[share]:.2%} of the "
            f"bytes, PSNR {best['metrics.psnr']:.2f} dB ({-best['gap']:+.2f} dB)."
        )
    lines = [f"{what} target ({rule}): **missed**. Closest points:"]
    for _, r in pool.sort_values(share).head(4).iterrows():
        lines.append(
            f"  - `{r['label']}`: {r[share]:.2%} of the bytes, PSNR "
            f"{r['metrics.psnr']:.2f} dB ({-r['gap']:+.2f} dB)"
        )
    return "\n".join(lines)


def table(df) -> str:
    lines = [
        "| point | family | MiB/device per image | steady MiB/device/step | PSNR dB | SSIM | "
        "CLIP | prompt acc. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _, r in df.iterrows():
        lines.append(
            f"| {r['label']} | {r['family']} | {r['bytes_per_image'] / 2**20:.3f} | "
            f"{r['metrics.steady_bytes_per_device'] / 2**20:.3f} | {r['metrics.psnr']:.2f} | "
            f"{r['metrics.ssim']:.4f} | {r['metrics.clip_score']:.2f} | "
            f"{r['metrics.prompt_accuracy']:.1%} |"
        )
    return "\n".join(lines)


def plot(df, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, metric, label in (
        (axes[0], "metrics.psnr", "PSNR vs single (dB)"),
        (axes[1], "metrics.prompt_accuracy", "prompt accuracy"),
    ):
        for fam, part in df.groupby("family"):
            ax.scatter(part["bytes_per_image"] / 2**20, part[metric], label=fam, s=28)
        ax.set_xscale("log")
        ax.set_xlabel("MiB received per device per image (log)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path)
    args = p.parse_args(argv)
    for folder in args.folders:
        df = frame(folder)
        if df.empty:
            raise SystemExit(f"{folder}: no ok records")
        text = "\n\n".join([f"# {folder.name}: quality against bytes", table(df), *targets(df)])
        (folder / "frontier.md").write_text(text + "\n")
        plot(df, folder / "plots" / "frontier.png", folder.name)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
