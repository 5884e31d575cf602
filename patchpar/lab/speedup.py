"""Speedups of a run against the `single` and `sync_patch` runs of the same point in the same
runs file: ratios of median denoising times, measured like for like (docs/design.md §4, Time).
The references run without a step cache; a run with a cache is also compared with `single`
under the same cache (what the parallelism adds to the cache).

Like for like: the same model, sampler, size, prompts and batch; for a run in launched
processes (`mesh.processes` >= 1, one core each), `single` launched as one process on one core;
for a run in one process, `single` in one process. Fake CPU devices in one process share the
cores, so their ratio is no speedup: it is recorded as null, with the reason.
"""

from __future__ import annotations

from pathlib import Path

from patchpar.lab.config import CacheConfig, MeshConfig, RunConfig
from patchpar.lab.configio import to_dict, with_defaults
from patchpar.lab.results import read_records

SPEEDUP_KEYS = (
    "speedup_vs_single",
    "speedup_vs_sync_patch",
    "steady_speedup_vs_single",
    "speedup_vs_single_same_cache",
)
NO_CACHE = to_dict(CacheConfig())


def same_work(config: dict) -> tuple:
    """What a reference run must share with a run to be compared in time."""
    return (
        config.get("model"),
        config.get("sampler"),
        config.get("prompts"),
    )


def _reference(
    records: list[dict], config: dict, strategy: str, mesh: dict, cache: dict = NO_CACHE
) -> dict | None:
    found = None
    for r in records:
        c = r["config"]
        m = with_defaults(MeshConfig, c.get("mesh", {}))  # older records lack new fields
        if (
            r.get("status") == "ok"
            and not c.get("measure", {}).get("compute_only")
            and c["strategy"]["name"] == strategy
            and m == mesh
            and _cache_key(c.get("cache", {})) == _cache_key(cache)
            and same_work(c) == same_work(config)
            and r.get("metrics", {}).get("denoise_s_median")
        ):
            found = r  # the latest one
    return found


def speedups(config: RunConfig, metrics: dict, runs_file: Path) -> dict:
    """{speedup_vs_single, speedup_vs_sync_patch, steady_speedup_vs_single, speedup_note};
    a speedup is null when its reference is not recorded yet or the devices are fake."""
    out: dict = dict.fromkeys(SPEEDUP_KEYS)
    lay = metrics.get("layout", {})
    mesh = config.mesh
    if lay.get("platform") == "cpu" and lay.get("processes") == 1 and mesh.devices > 1:
        out["speedup_note"] = (
            f"{mesh.devices} fake CPU devices in one process share its cores: wall time is not "
            f"a speedup (run with --processes {mesh.devices})"
        )
        return out
    cfg = to_dict(config)
    records = read_records(runs_file, skip_bad=True, require=("config", "status"))
    own = {"denoise_s_median": metrics["denoise_s_median"],
           "step_s_median": metrics["step_s_median"]}  # fmt: skip
    single_mesh = to_dict(MeshConfig(processes=1 if mesh.processes else 0))
    this_mesh = to_dict(mesh)
    uncached = config.cache.name == "none"
    is_single = config.strategy.name == "single" and this_mesh == single_mesh
    single = _metrics(_reference(records, cfg, "single", single_mesh), own,
                      is_single and uncached)  # fmt: skip
    sync = _metrics(_reference(records, cfg, "sync_patch", this_mesh), own,
                    config.strategy.name == "sync_patch" and uncached)  # fmt: skip
    same = (
        None
        if uncached
        else _metrics(_reference(records, cfg, "single", single_mesh, cfg["cache"]), own, is_single)
    )
    t = metrics["denoise_s_median"]
    notes = []
    if single:
        out["speedup_vs_single"] = single["denoise_s_median"] / t
        steady = metrics.get("steady_step_s_median")
        if steady:
            out["steady_speedup_vs_single"] = single["step_s_median"] / steady
    else:
        notes.append("no single run of this point recorded yet (run it first)")
    if sync:
        out["speedup_vs_sync_patch"] = sync["denoise_s_median"] / t
    if same:
        out["speedup_vs_single_same_cache"] = same["denoise_s_median"] / t
    elif not uncached:
        notes.append(f"no single run with cache {config.cache.label()} recorded yet")
    if lay.get("oversubscribed"):
        notes.append(
            f"oversubscribed: {mesh.processes} processes on {len(set(lay['cores']))} core(s)"
        )
    out["speedup_note"] = "; ".join(notes) or None
    return out


def _cache_key(cache: dict) -> str:
    """A cache config as the cache it makes (an option left unset and the same value given
    are one cache); one that does not make a cache stays its plain data."""
    from patchpar.sampling.cache import make_cache

    c = with_defaults(CacheConfig, cache)
    options = {k: v for k, v in c.items() if k != "name" and v is not None}
    try:
        made = make_cache(c["name"], **options)
    except (ValueError, TypeError):
        return repr(sorted(c.items()))
    return "none" if made is None else made.describe()


def _metrics(record: dict | None, own: dict, is_self: bool) -> dict | None:
    if is_self:
        return own
    return record["metrics"] if record else None
