"""`patchpar table RESULTS`: records -> a markdown table, grouped and sorted by the keys named.

Keys are dotted paths into a record (`config.strategy.portion`, `metrics.psnr`); a short key is
looked up as given, then under `config.`, then under `metrics.` (`mesh.devices`, `psnr`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from patchpar.lab.results import read_records

DEFAULT_COLUMNS = (
    "label",
    "mesh.devices",
    "mesh.cfg",
    "bytes_per_device_per_step",
    "step_s_median",
    "compile_s",
    "psnr",
    "ssim",
    "status",
)
# quality metrics that a summary shows when some record has them
OPTIONAL_COLUMNS = ("lpips", "fid", "fid_gt", "clip_score", "prompt_accuracy")
# timing columns a summary shows when some record has them (runs in launched processes)
SPEEDUP_COLUMNS = ("mesh.processes", "steady_step_s_median", "speedup_vs_single",
                   "speedup_vs_sync_patch")  # fmt: skip


def summary_columns(records: list[dict]) -> tuple[str, ...]:
    """DEFAULT_COLUMNS, with the optional quality metrics some record measured before status."""
    extra = tuple(
        k for k in OPTIONAL_COLUMNS if any(r.get("metrics", {}).get(k) is not None for r in records)
    )
    timing = ()
    if any(r.get("config", {}).get("mesh", {}).get("processes") for r in records):
        timing = SPEEDUP_COLUMNS
    cols = DEFAULT_COLUMNS
    for key, default in (("data", 1), ("fsdp", False)):  # right after cfg, where a record set it
        if any(r.get("config", {}).get("mesh", {}).get(key, default) != default for r in records):
            at = cols.index("mesh.cfg") + 1
            cols = cols[:at] + (f"mesh.{key}",) + cols[at:]
    return cols[:-1] + timing + extra + cols[-1:]


# key -> (header, format)
FORMATS = {
    "bytes_per_device_per_step": ("MiB/device/step", lambda v: f"{v / 2**20:.3f}"),
    # analytic: the released DistriFusion / PCPP code's pattern for the same run
    "released_bytes_per_device_per_step": (
        "released-code MiB/device/step (analytic)",
        lambda v: f"{v / 2**20:.3f}",
    ),
    "steady_bytes_per_device": ("steady MiB/device/step", lambda v: f"{v / 2**20:.3f}"),
    "warmup_bytes_per_device": ("warm-up MiB/device/step", lambda v: f"{v / 2**20:.3f}"),
    "stale_bytes_per_device": ("stale MiB/device", lambda v: f"{v / 2**20:.3f}"),
    "step_s_median": ("ms/step (median)", lambda v: f"{v * 1e3:.1f}"),
    "warmup_step_s_median": ("warm-up ms/step", lambda v: f"{v * 1e3:.1f}"),
    "steady_step_s_median": ("steady ms/step", lambda v: f"{v * 1e3:.1f}"),
    "speedup_vs_single": ("speedup vs single", lambda v: f"{v:.2f}x"),
    "speedup_vs_sync_patch": ("vs sync_patch", lambda v: f"{v:.2f}x"),
    "steady_speedup_vs_single": ("steady speedup vs single", lambda v: f"{v:.2f}x"),
    "mesh.processes": ("processes", str),
    "denoise_s_median": ("s/image batch (median)", lambda v: f"{v:.3f}"),
    "compile_s": ("compile s", lambda v: f"{v:.1f}"),
    "flops_per_device_per_step": ("GFLOP/device/step", lambda v: f"{v / 1e9:.2f}"),
    "psnr": ("PSNR dB", lambda v: f"{v:.2f}"),
    "ssim": ("SSIM", lambda v: f"{v:.4f}"),
    "latent_max_abs_diff": ("max |Δ latent|", lambda v: f"{v:.2e}"),
    "lpips": ("LPIPS", lambda v: f"{v:.4f}"),
    "fid": ("FID vs single", lambda v: f"{v:.3f}"),
    "fid_gt": ("FID vs ground truth", lambda v: f"{v:.2f}"),
    "clip_score": ("CLIP score", lambda v: f"{v:.2f}"),
    "prompt_accuracy": ("prompt accuracy", lambda v: f"{100 * v:.1f}%"),
    "psnr_sem": ("PSNR s.e.", lambda v: f"{v:.2f}"),
    "ssim_sem": ("SSIM s.e.", lambda v: f"{v:.4f}"),
    "clip_score_sem": ("CLIP s.e.", lambda v: f"{v:.2f}"),
    "prompt_accuracy_sem": ("accuracy s.e.", lambda v: f"{100 * v:.1f}%"),
    "quality_samples": ("images", str),
    "label": ("strategy", str),
    "mesh.devices": ("devices", str),
    "mesh.cfg": ("cfg", str),
    "mesh.data": ("data", str),
    "mesh.fsdp": ("fsdp", lambda v: "yes" if v else "no"),
}


@dataclass(frozen=True)
class TableConfig:
    """Print a markdown table of records."""

    results: Annotated[tuple[Path, ...], tyro.conf.Positional]
    """Results folders (holding runs.jsonl) or runs.jsonl files."""
    columns: tuple[str, ...] = DEFAULT_COLUMNS
    """Keys to show (short keys look under config. then metrics.)."""
    sort_by: tuple[str, ...] = ("mesh.devices", "label")
    """Keys to sort rows by, in order."""
    group_by: str | None = None
    """A key: one table per value, under a heading."""
    all_runs: bool = False
    """Show every record; by default only the latest of each point (config)."""
    out: Path | None = None
    """Also write the table to this file."""


def load_records(paths, latest_only: bool = True) -> list[dict]:
    """Records of every runs.jsonl named (folder or file), each with `_dir` (its folder) for
    finding its images; by default only the latest record of each point."""
    out = []
    for p in paths:
        p = Path(p)
        f = p / "runs.jsonl" if p.is_dir() else p
        if not f.is_file():
            raise ValueError(
                f"no records at {str(p)!r} (expected a folder with runs.jsonl, or the file)"
            )
        # a malformed line or a record without its config is skipped, with a message naming it
        for r in read_records(f, skip_bad=True, require=("config", "status")):
            out.append({**r, "_dir": str(f.parent)})
    if latest_only:
        seen: dict = {}
        for r in out:
            cfg = dict(r.get("config", {}))
            cfg.pop("results", None)
            seen[(r["_dir"], json.dumps(cfg, sort_keys=True))] = r
        out = list(seen.values())
    return out


def get(record: dict, key: str):
    """Value at a dotted key (short keys look under config. and metrics.); None if absent."""
    for full in (key, f"config.{key}", f"metrics.{key}"):
        node = record
        for part in full.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            return node
    return None


def _sort_value(v):
    if v is None:
        return (2, "")
    if isinstance(v, int | float) and not isinstance(v, bool):
        return (0, v)
    return (1, str(v))


def _cell(key: str, v) -> str:
    if v is None:
        return "—"
    short = key.removeprefix("metrics.").removeprefix("config.")
    fmt = FORMATS.get(short, (None, None))[1]
    if fmt is not None:
        try:
            return fmt(v)
        except (TypeError, ValueError):
            return str(v)
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return str(v)


def markdown(records: list[dict], columns=DEFAULT_COLUMNS, sort_by=(), group_by=None) -> str:
    """The records as one markdown table (or one per value of `group_by`)."""
    keys = ((group_by,) if group_by else ()) + tuple(sort_by)  # groups in order of their value
    rows = sorted(records, key=lambda r: tuple(_sort_value(get(r, k)) for k in keys))
    headers = [
        FORMATS.get(c.removeprefix("metrics.").removeprefix("config."), (c,))[0] for c in columns
    ]

    def table(rs):
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for r in rs:
            cells = [_cell(c, get(r, c)) for c in columns]
            same = get(r, "psnr_identical_images")
            if r.get("status") == "ok" and same and "psnr" in columns:
                # the mean is over the images that differ; say how many were identical
                i = columns.index("psnr")
                n = get(r, "quality_samples")
                if get(r, "identical"):
                    cells[i] = "∞ (identical)"
                elif get(r, "psnr") is None:  # a record from before the mean skipped them
                    cells[i] = f"∞ ({same}/{n} identical)"
                else:
                    cells[i] = f"{cells[i]} ({same}/{n} identical)"
            lines.append("| " + " | ".join(cells) + " |")
        failed = [r for r in rs if r.get("status") not in (None, "ok")]
        if failed:
            lines.append("")
            lines += [f"- {r.get('label')} ({r['status']}): {r.get('error')}" for r in failed]
        return "\n".join(lines)

    if group_by is None:
        return table(rows)
    groups: dict = {}
    for r in rows:
        groups.setdefault(get(r, group_by), []).append(r)
    parts = [f"### {group_by} = {value}\n\n{table(rs)}" for value, rs in groups.items()]
    return "\n\n".join(parts)


def run_table(config: TableConfig) -> str:
    records = load_records(config.results, latest_only=not config.all_runs)
    text = markdown(records, config.columns, config.sort_by, config.group_by)
    if config.out is not None:
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
        Path(config.out).write_text(text + "\n")
    return text
