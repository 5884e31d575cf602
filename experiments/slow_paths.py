"""The slow-path table of `experiments/sweeps/slow_paths.yaml`: each point's steady step on 2
launched processes beside the same point with every collective stood in (compute alone), the
rest (measured - compute alone: waiting at the collectives and the collectives themselves), and
FLOPs per device of the step.

    .venv/bin/python experiments/slow_paths.py runs/slow_paths [more folders...]

Prints a markdown table per folder (one sweep run each: ratios are taken inside a run, against
its own `single`), and writes table.md beside each runs.jsonl.
"""

from __future__ import annotations

import sys
from pathlib import Path


def table(folder: Path) -> str:
    from patchpar.lab.results import read_records

    records = [r for r in read_records(folder / "runs.jsonl", skip_bad=True) if r["status"] == "ok"]
    latest = {}
    for r in records:
        latest[(r["label"], bool(r["config"]["measure"].get("compute_only")))] = r
    single = latest[("single", False)]["metrics"]["step_s_median"]
    commits = sorted({r["provenance"]["git_commit"][:7] for r in records})
    lines = [
        f"`{folder}` (commit {', '.join(commits)}; `single` {single * 1e3:.1f} ms/step on one core)",
        "",
        "| point | steady ms/step | repeats' spread (whole run) | compute alone ms | rest ms "
        "| steady vs single | GFLOP/device/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for (label, alone), r in latest.items():
        if alone or label == "single":
            continue
        m = r["metrics"]
        phase = "steady" if m.get("steady_step_s_median") else "warmup"
        t = m[f"{phase}_step_s_median"]
        c = latest.get((label, True))
        ca = c["metrics"][f"{phase}_step_s_median"] if c else None
        runs = m["denoise_s_all"]
        spread = f"{min(runs):.2f}–{max(runs):.2f} s"
        flops = m.get("flops_per_device_per_step")
        lines.append(
            f"| {label}{' (warm-up step)' if phase == 'warmup' else ''} | {t * 1e3:.1f} | {spread} "
            f"| {ca * 1e3:.1f} | {(t - ca) * 1e3:+.1f} | {single / t:.2f}× | "
            f"{flops / 1e9:.1f} |"
            if ca
            else f"| {label} | {t * 1e3:.1f} | {spread} | — | — | {single / t:.2f}× | — |"
        )
    return "\n".join(lines)


def main(folders: list[str]) -> None:
    for f in folders:
        text = table(Path(f))
        (Path(f) / "table.md").write_text(text + "\n")
        print(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:] or ["runs/slow_paths"])
