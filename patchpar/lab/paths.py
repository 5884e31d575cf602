"""Where records are written. Two roots, kept apart:

- `results/`: the published records (committed; what README and paper_repro.md quote), written
  only when a command is told so (`--results results`, `--out results/...`);
- `runs/`: a user's own runs (git-ignored), where every command writes by default, so that each
  documented reproduction command re-measures on a fresh clone instead of finding the published
  records, and its output sits beside them for comparison (`patchpar table runs/X results/X`).
"""

from pathlib import Path

PUBLISHED = Path("results")
RUNS = Path("runs")


def runs_dir(name: str) -> Path:
    """An experiment script's default output folder: runs/<name>."""
    return RUNS / name
