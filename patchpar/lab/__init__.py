"""The experiment layer: typed configs, the `patchpar` command, sweeps, records, tables, plots
and launched processes. The library (models, parallel, sampling, pipelines, measure) never
imports it.

    from patchpar.lab import load_records
    df = load_records("results/speedup_cpu", "runs/speedup_cpu")   # a pandas DataFrame
"""


def load_records(*paths, latest: bool = False, ok_only: bool = False, shown=()):
    """Records as a pandas DataFrame, one row per record, dotted columns, and `point_label`
    for run records (`patchpar.lab.frames.load_records`)."""
    from patchpar.lab.frames import load_records as load

    return load(*paths, latest=latest, ok_only=ok_only, shown=shown)


__all__ = ["load_records"]
