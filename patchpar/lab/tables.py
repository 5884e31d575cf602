"""`patchpar table RESULTS`: records -> a markdown table, grouped and sorted by the keys named.

Keys are dotted paths into a record (`config.strategy.portion`, `metrics.psnr`); a short key is
looked up as given, then under `config.`, then under `metrics.` (`mesh.devices`, `psnr`).
A key that no record has is an error naming the nearest keys the records do have.

Points are told apart: the strategy column names, after the record's label (the strategy, the
cache and the quant mode: `RunConfig.label`), every other config field that differs among all
the records shown, across folders, and is not a column of its own, where a record's value is not
the field's default (`sync_patch mesh.data=2`, `distrifusion sampler.name=dpmpp_2m
sampler.steps=25`); records from several folders get a `records` column naming the folder
(`patchpar table runs/X results/X`: a re-run beside the published records).
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from patchpar.lab.config import RunConfig
from patchpar.lab.configio import point_config
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
    "speedup_vs_single_same_cache": ("vs single, same cache", lambda v: f"{v:.2f}x"),
    "blocks_computed": ("blocks computed", lambda v: f"{100 * v:.0f}%"),
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
    "records": ("records", str),
    "mesh.devices": ("devices", str),
    "mesh.cfg": ("cfg", str),
    "mesh.data": ("data", str),
    "mesh.fsdp": ("fsdp", lambda v: "yes" if v else "no"),
}


# config fields that say where records go or how long a worker may take, not what ran
NOT_A_POINT = ("results", "timeout_s", "experiment")
# config fields a record's label names already (`RunConfig.label`: the strategy and its
# options, the cache and its options, the quant mode)
LABELLED = ("strategy.", "cache.", "model.quant")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# the order in which config fields are named in a label (then alphabetical)
KEY_ORDER = ("model.", "mesh.", "sampler.", "prompts.", "measure.")


def _key_rank(key: str) -> tuple:
    rank = next((i for i, p in enumerate(KEY_ORDER) if key.startswith(p)), len(KEY_ORDER))
    return (rank, key)


@functools.cache
def _defaults() -> dict:
    """Today's RunConfig defaults as a flat point."""
    return _flat(point_config(RunConfig()))


def _point(record: dict) -> dict:
    """A record's config as a point, flat: fields older records lack filled in as they ran
    (`point_config`), then with today's defaults (a field added since behaves as before)."""
    return {**_defaults(), **_flat(point_config(record.get("config") or {}))}


def _json(v) -> str:
    return json.dumps(v, sort_keys=True)


def _base_label(record: dict) -> str:
    return str(record.get("label") or get(record, "strategy.name") or "?")


def varying_keys(records: list[dict], shown=()) -> list[str]:
    """The config keys (dotted, without `config.`) whose value differs among the records, in
    KEY_ORDER: every one, so that no difference between two points shown is hidden. Left out:
    where records go, the keys `shown` (columns or axes of their own), and the fields the
    records' labels name (`LABELLED`) where the labels tell their values apart (always, for
    labels `RunConfig.label` made)."""
    shown = {k.removeprefix("config.") for k in shown}
    flat = [_point(r) for r in records]
    keys = sorted(set().union(*flat) if flat else (), key=_key_rank)
    labels = [_base_label(r) for r in records]

    def said(key: str) -> bool:  # a field the label names, one value per label
        if not key.startswith(LABELLED):
            return False
        values: dict[str, set] = {}
        for label, f in zip(labels, flat, strict=True):
            values.setdefault(label, set()).add(_json(f.get(key)))
        return all(len(v) == 1 for v in values.values())

    return [
        k
        for k in keys
        if k.split(".")[0] not in NOT_A_POINT
        and k not in shown
        and len({_json(f.get(k)) for f in flat}) > 1
        and not said(k)
    ]


def _text(v) -> str:
    """A value as a label writes it: a string bare, unless empty or spaced (then quoted)."""
    if isinstance(v, str) and v and not any(c.isspace() for c in v):
        return v
    return json.dumps(v)


def _short(v) -> str:
    """A value as a label shows it: whole up to 24 characters, else its head and tail."""
    text = _text(v)
    return text if len(text) <= 24 else text[:12] + "…" + text[-11:]


def _shown_values(values: list) -> list[str]:
    """Each value as `_short` shows it, unless two different values would look the same: then
    every long one also gets a digest of its whole text (labels never collide)."""
    short = [_short(v) for v in values]
    seen: dict[str, str] = {}
    clash = any(
        seen.setdefault(t, _json(v)) != _json(v) for t, v in zip(short, values, strict=True)
    )
    if not clash:
        return short
    import hashlib

    return [
        t if t == _text(v) else f"{t}#{hashlib.sha1(_json(v).encode()).hexdigest()[:6]}"
        for t, v in zip(short, values, strict=True)
    ]


def point_labels(records: list[dict], shown=()) -> list[str]:
    """Each record's label (`RunConfig.label`: strategy, cache, quant mode) followed by the
    config fields that differ among all the records given (`point_extras`): two records whose
    points differ in anything but the `shown` keys never get the same label. Label the records
    of a figure or table all together, before choosing which to draw."""
    return [
        " ".join([_base_label(r), *extra])
        for r, extra in zip(records, point_extras(records, shown), strict=True)
    ]


def point_extras(records: list[dict], shown=()) -> list[list[str]]:
    """Per record, `key=value` for each config field that differs among the records
    (`varying_keys`) where its value is not the reference: the field's default where some
    record has it (a default is never spelled out), else the most common value (e.g.
    `mesh.fsdp=true` beside records without FSDP). Records that differ in a field never both
    hold its reference, so their labels differ."""
    keys = varying_keys(records, shown)
    flat = [_point(r) for r in records]
    values = {k: [_json(f.get(k)) for f in flat] for k in keys}
    defaults = _defaults()
    reference = {
        k: _json(defaults.get(k)) if _json(defaults.get(k)) in vs else max(vs, key=vs.count)
        for k, vs in values.items()
    }  # most common: the first of them
    shown_as = {k: _shown_values([f.get(k) for f in flat]) for k in keys}
    return [
        [f"{k}={shown_as[k][i]}" for k in keys if values[k][i] != reference[k]]
        for i in range(len(records))
    ]


def known_keys(records: list[dict]) -> set[str]:
    """Every dotted key the records have, full and short (without `config.`/`metrics.`)."""
    keys: set[str] = set()
    for r in records:
        for k in _flat({k: v for k, v in r.items() if not k.startswith("_")}):
            keys.add(k)
            for prefix in ("config.", "metrics."):
                if k.startswith(prefix):
                    keys.add(k.removeprefix(prefix))
    return keys


def check_keys(records: list[dict], keys, what: str) -> None:
    """ValueError for a key no record has, naming the nearest keys they do have."""
    if not records:
        return
    have = known_keys(records) | {"label", "records"}
    for key in keys:
        if key in have or any(k.startswith(key + ".") for k in have):
            continue
        near = difflib.get_close_matches(key, sorted(have), n=4, cutoff=0.5)
        if near:
            hint = f"; did you mean {', '.join(near)}?"
        else:  # nothing like it: what keys look like, from the records themselves
            varying = varying_keys(records) or ["mesh.devices", "sampler.steps"]
            metrics = [k for k in FORMATS if k in have and "." not in k][:6]
            hint = (
                f"; keys are dotted paths such as label, {', '.join([*varying[:4], *metrics])} "
                f"(short keys look under config. and metrics.)"
            )
        raise ValueError(f"{what} {key!r}: no record has this key{hint}")


@dataclass(frozen=True)
class TableConfig:
    """Print a markdown table of records."""

    results: Annotated[tuple[Path, ...], tyro.conf.Positional]
    """Results folders (holding runs.jsonl) or runs.jsonl files."""
    columns: tuple[str, ...] | None = None
    """Keys to show (short keys look under config. then metrics.); default: the summary a
    sweep prints (the quality and timing metrics the records have)."""
    sort_by: tuple[str, ...] = ("mesh.devices", "label")
    """Keys to sort rows by, in order."""
    group_by: str | None = None
    """A key: one table per value, under a heading."""
    all_runs: bool = False
    """Show every record; by default only the latest of each point (config)."""
    out: Path | None = None
    """Also write the table to this file."""


def read_runs(paths, latest_only: bool = True) -> list[dict]:
    """The run records (`patchpar run`, `sweep`) of every runs.jsonl named (folder or file), as
    dicts, each with `_dir` (its folder) for finding its images; by default only the latest
    record of each point. For a DataFrame of any records: `patchpar.lab.load_records`."""
    out = []
    for p in paths:
        p = Path(p)
        f = p / "runs.jsonl" if p.is_dir() else p
        if not f.is_file():
            raise ValueError(
                f"no records at {str(p)!r} (expected a folder with runs.jsonl, or the file)"
            )
        if f.suffix != ".jsonl":
            raise ValueError(f"{str(f)!r} is not a records file (runs.jsonl, JSON lines)")
        # a malformed line or a record without its config is skipped, with a message naming it
        skipped: list[str] = []
        runs = read_records(f, skip_bad=True, require=("config", "status"), warn=skipped.append)
        if not runs and skipped:
            raise ValueError(
                f"{str(f)!r} holds no run records (JSON lines with config and status, as "
                "`patchpar run` writes; patchpar.lab.load_records reads any records)"
            )
        for msg in skipped:
            print(f"patchpar: warning: {msg}", file=sys.stderr, flush=True)
        out += [{**r, "_dir": str(f.parent)} for r in runs]
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
    """The records as one markdown table (or one per value of `group_by`). The strategy column
    names what else tells its point apart (`point_labels`); records from several folders get a
    `records` column."""
    columns = tuple(columns)
    if len({r.get("_dir") for r in records}) > 1 and "records" not in columns:
        at = columns.index("label") + 1 if "label" in columns else 0
        columns = columns[:at] + ("records",) + columns[at:]
    shown = columns + ((group_by,) if group_by else ())
    named = [
        {**r, "_label": lab} for r, lab in zip(records, point_labels(records, shown), strict=True)
    ]
    keys = ((group_by,) if group_by else ()) + tuple(sort_by)  # groups in order of their value
    rows = sorted(named, key=lambda r: tuple(_sort_value(_value(r, k)) for k in keys))
    headers = [
        FORMATS.get(c.removeprefix("metrics.").removeprefix("config."), (c,))[0] for c in columns
    ]

    def table(rs):
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for r in rs:
            cells = [_cell(c, _value(r, c)) for c in columns]
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
            lines += [f"- {r.get('_label')} ({r['status']}): {r.get('error')}" for r in failed]
        return "\n".join(lines)

    if group_by is None:
        return table(rows)
    groups: dict = {}
    for r in rows:
        groups.setdefault(_value(r, group_by), []).append(r)
    parts = [f"### {group_by} = {value}\n\n{table(rs)}" for value, rs in groups.items()]
    return "\n\n".join(parts)


def _value(record: dict, column: str):
    if column == "label":
        return record.get("_label", record.get("label"))
    if column == "records":
        return record.get("_dir")
    return get(record, column)


def run_table(config: TableConfig) -> str:
    records = read_runs(config.results, latest_only=not config.all_runs)
    check_keys(records, config.columns or (), "--columns")
    check_keys(records, config.sort_by, "--sort-by")
    check_keys(records, (config.group_by,) if config.group_by else (), "--group-by")
    columns = config.columns or summary_columns(records)
    text = markdown(records, columns, config.sort_by, config.group_by)
    if config.out is not None:
        Path(config.out).parent.mkdir(parents=True, exist_ok=True)
        Path(config.out).write_text(text + "\n")
    return text
