"""`patchpar plot RESULTS`: matplotlib figures drawn from records only (never from stdout).

Each `plot_*` takes run records (`patchpar.lab.tables.read_runs`) and an Axes, so a notebook draws
the same figures; each returns False, drawing nothing, when the records lack its data. Series,
bars and image columns are named by `point_labels` over all the records given (not only those a
figure draws): the strategy and every config field that differs among them (other than the
figure's axes), so that no two points share a name. Series are told apart by a colour and
marker pair of their own (`style`), however many there are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import tyro

from patchpar.lab.paths import RUNS
from patchpar.lab.results import check_writable, published
from patchpar.lab.tables import get, point_extras, point_labels, read_runs


@dataclass(frozen=True)
class PlotConfig:
    """Write PNG plots (and a grid of every run's images) from records."""

    results: Annotated[tuple[Path, ...], tyro.conf.Positional]
    """Results folders (holding runs.jsonl) or runs.jsonl files."""
    out: Path | None = None
    """Folder for the PNGs (default: with one records folder, its plots/; with several,
    runs/plots/<their names joined by +>). A folder under the published results/ only when
    named here."""
    prompt_grid: bool = False
    """Also one PNG per run: a row per prompt, a column per seed (the first 10)."""


COLOURS = tuple(f"C{i}" for i in range(10))  # matplotlib's default cycle
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def style(i: int) -> dict:
    """Colour and marker of series i: the pair differs for every i below 40 (lcm(10, 8)), where
    colours alone repeat after 10."""
    return {"color": COLOURS[i % len(COLOURS)], "marker": MARKERS[i % len(MARKERS)]}


def _ok(records, *keys):
    return [
        r for r in records if r.get("status") == "ok" and all(get(r, k) is not None for k in keys)
    ]


def _by(records, key):
    groups: dict = {}
    for r in records:
        groups.setdefault(get(r, key), []).append(r)
    return groups


def _named(records, shown) -> list[dict]:
    """Copies of the records with `_name`: the point label without the fields in `shown`."""
    return [{**r, "_name": n} for r, n in zip(records, point_labels(records, shown), strict=True)]


def _lines(ax, records, x_key, y_key, scale=1.0, group="_name"):
    """One line per value of `group` (records named by `_named` already, for `_name`)."""
    for i, (name, rs) in enumerate(sorted(_by(records, group).items(), key=lambda kv: str(kv[0]))):
        pts = sorted((get(r, x_key), get(r, y_key) * scale) for r in rs)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=str(name), **style(i))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def plot_bytes_vs_devices(records, ax) -> bool:
    """Bytes received per device per denoising step (mean over the run's steps) vs devices."""
    rs = _ok(_named(records, ("mesh.devices",)), "bytes_per_device_per_step", "mesh.devices")
    if not rs:
        return False
    _lines(ax, rs, "mesh.devices", "bytes_per_device_per_step", 1 / 2**20)
    ax.set(xlabel="devices", ylabel="MiB received / device / step", title="Communication")
    return True


def plot_psnr_vs_devices(records, ax) -> bool:
    """PSNR against the single-device output vs devices, per strategy (identical runs left out)."""
    named = _named(records, ("mesh.devices",))
    rs = [r for r in _ok(named, "psnr", "mesh.devices") if r.get("label") != "single"]
    if not rs:
        return False
    _lines(ax, rs, "mesh.devices", "psnr")
    ax.set(xlabel="devices", ylabel="PSNR vs single (dB)", title="Quality vs devices")
    return True


def plot_step_time(records, ax) -> bool:
    """Median time per denoising step, per strategy, one bar per device count."""
    rs = _ok(_named(records, ("mesh.devices",)), "step_s_median", "mesh.devices")
    if not rs:
        return False
    labels = sorted({r["_name"] for r in rs})
    devices = sorted({get(r, "mesh.devices") for r in rs})
    width = 0.8 / len(devices)
    for i, d in enumerate(devices):
        by = {r["_name"]: get(r, "step_s_median") * 1e3 for r in rs if get(r, "mesh.devices") == d}
        xs = [j + i * width for j, lab in enumerate(labels) if lab in by]
        ax.bar(xs, [by[lab] for lab in labels if lab in by], width, label=f"{d} device(s)",
               color=COLOURS[i % len(COLOURS)])  # fmt: skip
    ax.set_xticks(
        np.arange(len(labels)) + 0.4 - width / 2, labels, rotation=30, ha="right", fontsize=7
    )
    title = "Time per step"
    if any(
        get(r, "provenance.platform") == "cpu"
        and get(r, "mesh.devices") > 1
        and not get(r, "config.mesh.processes")
        for r in rs
    ):
        title += "\n(fake CPU devices share the cores: not a speedup)"
    ax.set(ylabel="ms / step (median)", title=title)
    ax.legend(fontsize=7)
    return True


def plot_psnr_vs_portion(records, ax) -> bool:
    """PCPP: PSNR against single vs the attended portion of each neighbour patch."""
    extras = point_extras(records, ("strategy.portion", "mesh.devices"))
    pcpp = [r for r in records if get(r, "strategy.name") == "pcpp"]
    # the strategy's own options that differ among the PCPP records, but the x axis
    options = sorted(
        k for k in {k for r in pcpp for k in (r.get("strategy") or {})} - {"name", "portion"}
        if len({json.dumps(get(r, f"strategy.{k}")) for r in pcpp}) > 1
    )  # fmt: skip
    series = [
        {**r, "_series": " ".join(
            [f"{get(r, 'mesh.devices')} devices"]
            + [f"{k}={get(r, f'strategy.{k}')}" for k in options] + extra)}
        for r, extra in zip(records, extras, strict=True)
    ]  # fmt: skip
    rs = [r for r in _ok(series, "psnr", "strategy.portion") if get(r, "strategy.name") == "pcpp"]
    if len({get(r, "strategy.portion") for r in rs}) < 2:
        return False
    _lines(ax, rs, "strategy.portion", "psnr", group="_series")
    ax.set(xlabel="PCPP portion", ylabel="PSNR vs single (dB)", title="PCPP portion")
    return True


def plot_speedup(records, ax) -> bool:
    """Measured speedup against `single` (whole run, and the steady phase alone), per strategy
    and model, with the ideal (N devices) as a line; runs in launched processes only."""
    named = _named(records, ("model.name", "mesh.devices", "mesh.processes"))
    rs = [r for r in _ok(named, "speedup_vs_single", "mesh.devices") if get(r, "mesh.devices") > 1]
    if not rs:
        return False
    keys = sorted({(get(r, "model.name"), get(r, "mesh.devices"), r["_name"]) for r in rs})
    latest = {(get(r, "model.name"), get(r, "mesh.devices"), r["_name"]): r for r in rs}
    xs = np.arange(len(keys))
    whole = [get(latest[k], "speedup_vs_single") for k in keys]
    steady = [get(latest[k], "steady_speedup_vs_single") or np.nan for k in keys]
    ax.bar(xs - 0.2, whole, 0.4, label="whole run")
    ax.bar(xs + 0.2, steady, 0.4, label="steady phase")
    for i, k in enumerate(keys):  # the ideal: N devices do the work N times as fast
        ax.hlines(k[1], i - 0.45, i + 0.45, colors="k", linestyles="--", lw=1)
    ax.set_xticks(xs, [f"{m}: {lab} ({n})" for m, n, lab in keys], rotation=30, ha="right",
                  fontsize=7)  # fmt: skip
    ax.set(ylabel="speedup vs single on one core", title="Measured speedup (dashed: ideal)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return True


def plot_psnr_vs_blocks(records, ax) -> bool:
    """Step caches: PSNR against uncached `single` vs the fraction of block calls that ran, one
    line per strategy and cache (the strategy's uncached run at 1, on each of its lines)."""
    rs = [r for r in _ok(records, "psnr", "blocks_computed") if np.isfinite(get(r, "psnr"))]
    caches = sorted({get(r, "cache.name") or "none" for r in rs} - {"none"})
    if not caches:
        return False
    series = []
    for r in rs:
        strategy = str(r.get("label") or "?").split(" + ")[0]
        cache = get(r, "cache.name") or "none"
        for c in caches if cache == "none" else [cache]:
            series.append({**r, "_series": f"{strategy}, {c}"})
    _lines(ax, series, "blocks_computed", "psnr", group="_series")
    ax.set(xlabel="fraction of block calls computed", ylabel="PSNR vs uncached single (dB)",
           title="Step caches")  # fmt: skip
    return True


PLOTS = {
    "bytes_vs_devices": plot_bytes_vs_devices,
    "psnr_vs_devices": plot_psnr_vs_devices,
    "step_time_vs_strategy": plot_step_time,
    "psnr_vs_portion": plot_psnr_vs_portion,
    "speedup_vs_strategy": plot_speedup,
    "psnr_vs_blocks_computed": plot_psnr_vs_blocks,
}


def image_grid(records, path: Path, max_images: int = 4) -> bool:
    """One column per run (sorted by devices, then strategy), one row per image."""
    import matplotlib.pyplot as plt
    from PIL import Image

    named = _named(records, ("mesh.devices",))
    rs = [r for r in named if r.get("status") == "ok" and r.get("images")]
    if not rs:
        return False
    rs = sorted(rs, key=lambda r: (get(r, "mesh.devices") or 0, r["_name"]))
    rows = min(max_images, max(len(r["images"]) for r in rs))
    fig, axes = plt.subplots(
        rows, len(rs), figsize=(2.2 * len(rs), 2.2 * rows + 0.4), squeeze=False
    )
    for j, r in enumerate(rs):
        root = Path(r["_dir"])  # image paths are relative to the records' folder
        for i in range(rows):
            ax = axes[i, j]
            ax.axis("off")
            if i < len(r["images"]) and (root / r["images"][i]).is_file():
                ax.imshow(np.asarray(Image.open(root / r["images"][i])))
        title = r["_name"].replace(" ", "\n", 1)  # strategy, then what else tells it apart
        axes[0, j].set_title(f"{title}\n{get(r, 'mesh.devices')} dev", fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def prompt_grid(record: dict, path: Path, max_seeds: int = 10) -> bool:
    """One run's images: a row per prompt, a column per seed, the prompt at the left."""
    import matplotlib.pyplot as plt
    from PIL import Image

    cfg = record.get("config", {}).get("prompts", {})
    prompts, seeds = cfg.get("prompts", []), cfg.get("seeds", [])[:max_seeds]
    root = Path(record["_dir"])
    files = {Path(p).name: root / p for p in record.get("images", [])}
    if not prompts or not seeds or not files:
        return False
    fig, axes = plt.subplots(
        len(prompts),
        len(seeds),
        figsize=(0.9 * len(seeds) + 1.6, 0.9 * len(prompts)),
        squeeze=False,
    )
    for i, prompt in enumerate(prompts):
        for j, seed in enumerate(seeds):
            ax = axes[i, j]
            ax.set_xticks([])
            ax.set_yticks([])
            f = files.get(f"p{i}_s{seed}.png")
            if f is not None and f.is_file():
                ax.imshow(np.asarray(Image.open(f)), cmap="gray")
        axes[i, 0].set_ylabel(
            prompt.removeprefix("a photo of a "), rotation=0, ha="right", fontsize=7
        )
    fig.suptitle(f"{record['label']}, {get(record, 'mesh.devices')} device(s)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plots_folder(config: PlotConfig) -> Path:
    """Where the PNGs go: `out` as given; else, with one records folder, its plots/; with
    several, runs/plots/<their names joined by +>, in none of them. ValueError where that
    default lies in the published results/ (a folder there is written only when named)."""
    if config.out is not None:
        return Path(config.out)
    folders = list(dict.fromkeys(p if p.is_dir() else p.parent for p in map(Path, config.results)))
    if len(folders) == 1:
        out = folders[0] / "plots"
    else:
        names = [f.resolve().name for f in folders]
        if len(set(names)) < len(names):  # runs/x beside results/x
            names = [f"{f.resolve().parent.name}-{f.resolve().name}" for f in folders]
        out = RUNS / "plots" / "+".join(names)
    if published(out):
        raise ValueError(
            f"plots would go to {str(out)!r}, in the published records (results/, committed): "
            f"pass --out (a folder under runs/, or --out {out} to update the published plots)"
        )
    return out


def run_plot(config: PlotConfig) -> dict[str, str]:
    """Write every plot the records allow into `plots_folder(config)`; returns name -> path,
    or the reason it was skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = check_writable(plots_folder(config), "out")
    records = read_runs(config.results)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, fn in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        if fn(records, ax):
            fig.tight_layout()
            fig.savefig(out / f"{name}.png", dpi=100)
            written[name] = str(out / f"{name}.png")
        else:
            what = fn.__doc__.splitlines()[0].rstrip(".")
            written[name] = f"skipped: no records with the data for it ({what})"
        plt.close(fig)
    grid = out / "grid.png"
    written["grid"] = str(grid) if image_grid(records, grid) else "skipped: no images recorded"
    if config.prompt_grid:
        for r in records:
            if r.get("status") == "ok":
                path = out / f"prompt_grid_{r['run_id']}.png"
                written[f"prompt_grid {r['run_id']}"] = (
                    str(path) if prompt_grid(r, path) else "skipped: no images recorded"
                )
    return written
