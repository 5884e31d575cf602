"""Latency projection (issue 15): hardware profiles as data, the model's arithmetic on
hand-built workloads, workloads read from lowered programs, and `patchpar project`. The
committed paper checks re-derived from their records: test_projection_checks.py."""

import dataclasses
import json
import math

import pytest
from test_comm import SYNTHETIC

from patchpar import hardware
from patchpar.lab.cli import main
from patchpar.lab.config import build_plan
from patchpar.measure.comm import collective_groups, parse_collectives
from patchpar.measure.projection import fit_compute, project
from patchpar.measure.workload import Workload, WorkloadCache, compute_workload

# ------------------------------------------------------------------ profiles


def test_every_profile_loads_with_a_source_for_every_figure():
    names = hardware.names()
    for want in ("a100-sxm", "a100-pcie", "h100-sxm", "h200-sxm", "l40s", "rtx4090"):
        assert want in names
    for want in ("tpu-v5e", "tpu-v5p", "tpu-v6e", "cpu-gloo"):
        assert want in names
    for p in hardware.load_all():
        assert p.peak_flops > 0 and p.bytes_per_s("all-gather") > 0
        assert all(p.sources[k].strip() for k in hardware.SOURCED), p.name
        assert 0 < p.flop_efficiency <= 1 and p.call_overhead_s >= 0


def test_profile_arithmetic():
    p = hardware.load("a100-sxm")
    # rings: n - 1 steps for gathers and reductions; direct sends: log2 n; one hop for a permute
    assert p.latency_s("all-reduce", 8) == pytest.approx(7 * p.latency_s("all-reduce", 2))
    assert p.latency_s("all-gather", 4) == pytest.approx(3 * p.latency_s("all-gather", 2))
    assert p.latency_s("all-to-all", 8) == pytest.approx(3 * p.latency_s("all-to-all", 2))
    assert p.latency_s("collective-permute", 8) == p.latency_s("collective-permute", 2)
    assert p.bytes_per_s("all-gather") == pytest.approx(300e9 * 0.8)
    assert hardware.load("rtx4090").bytes_per_s("all-gather") == pytest.approx(31.5e9 * 0.8 / 2)
    assert p.collective_s("all-gather", 2, 3, 2.4e9) == pytest.approx(
        3 * p.latency_s("all-gather", 2) + 0.01
    )
    # efficiency rises with the work per call and tends to flop_efficiency
    p = dataclasses.replace(p, call_overhead_s=0.01)
    assert p.efficiency(1e12) < p.efficiency(1e14) < p.flop_efficiency


def test_unknown_hardware_lists_the_known():
    with pytest.raises(ValueError, match="unknown hardware 'b200'.*a100-sxm"):
        hardware.load("b200")


def _profile_text(**drop_or_set):
    raw = (hardware.FOLDER / "a100-sxm.yaml").read_text()
    import yaml

    d = yaml.safe_load(raw)
    for k, v in drop_or_set.items():
        if v is None:
            d.pop(k)
        else:
            d[k] = v
    return yaml.safe_dump(d)


def test_profile_missing_a_field_names_field_and_file(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text(_profile_text(launch_s=None))
    with pytest.raises(ValueError, match=f"{f}.*missing field 'launch_s'"):
        hardware.load(f)
    f.write_text(_profile_text(topology="infiniband"))
    with pytest.raises(ValueError, match="topology='infiniband'; known"):
        hardware.load(f)
    f.write_text(_profile_text(sources={"peak_flops": "x"}))
    with pytest.raises(ValueError, match="no source given for .*hbm_bytes_per_s"):
        hardware.load(f)
    f.write_text(_profile_text(compute={"flop_efficiency": 0.5, "fitted_on": "x"}))
    with pytest.raises(ValueError, match="missing field 'compute.call_overhead_s'"):
        hardware.load(f)
    four = {"flop_efficiency": 0.5, "call_overhead_s": 0, "a": 1, "b": 2, "fitted_on": "x"}
    f.write_text(_profile_text(compute=four))
    with pytest.raises(ValueError, match="4 fitted constants"):
        hardware.load(f)
    f.write_text(_profile_text(compute={"borrow": "h100-sxm"}))  # h100 borrows in turn
    with pytest.raises(ValueError, match="borrows in turn"):
        hardware.load(f)


def test_write_fit_replaces_only_the_compute_block(tmp_path, monkeypatch):
    import shutil

    shutil.copy(hardware.FOLDER / "a100-sxm.yaml", tmp_path / "a100-sxm.yaml")
    before = (tmp_path / "a100-sxm.yaml").read_text()
    monkeypatch.setattr(hardware, "FOLDER", tmp_path)
    hardware.write_fit("a100-sxm", 0.25, 0.002, "two points", "python fit.py")
    p = hardware.load("a100-sxm")
    assert (p.flop_efficiency, p.call_overhead_s) == (0.25, 0.002)
    assert p.compute_note == "fitted on two points"
    after = (tmp_path / "a100-sxm.yaml").read_text()
    assert before.split("compute:")[0] == after.split("compute:")[0]
    assert before.split("sources:")[1] == after.split("sources:")[1]


# ------------------------------------------------------------------ collectives grouped


def test_collective_groups_on_synthetic_hlo():
    groups = collective_groups(parse_collectives(SYNTHETIC, 8), 8)
    by = {(g["op"], g["group"], g["site"]): (g["count"], g["received_bytes"]) for g in groups}
    assert by == {
        ("collective-permute", 4, "halo"): (1, 2 * 8 * 16 * 2),
        ("all-gather", 4, "kv"): (1, 3 * 4 * 8 * 2),
        ("all-reduce", 4, "gn"): (1, 2 * 3 * 6 * 4 // 4),
        ("all-gather", 2, "cfg"): (1, 24 * 4),
        ("reduce-scatter", 8, "other"): (1, 7 * 16 * 4 // 8),
        ("all-to-all", 8, "other"): (1, 7 * 16 * 2 // 8),
    }


# ------------------------------------------------------------------ the model on hand-built workloads


def _workload(collectives, flops=1e12, stale=0, warmup_steps=4, sync_sites=("cfg", "other")):
    everything = ["halo", "gn", "kv", "cfg", "other"]
    return Workload(
        model="m",
        resolution=64,
        strategy="s",
        devices=2,
        cfg=1,
        batch=1,
        dtype="bfloat16",
        unet_batch=2,
        phases={
            ph: {"flops_per_device": flops, "collectives": collectives}
            for ph in ("warmup", "steady")
        },
        synchronous_sites={"warmup": everything, "steady": list(sync_sites)},
        stale_bytes_per_device=stale,
        warmup_steps=warmup_steps,
        encode_flops=0.0,
        decode_flops=0.0,
    )


def _hw(**kw):
    base = hardware.load("a100-sxm")
    fields = dict(
        peak_flops=1e12,
        flop_efficiency=1.0,
        call_overhead_s=0.0,
        collective_latency_s={"all-gather": 0.0},
        link_bytes_per_s=1e9,
        link_efficiency=1.0,
        topology="nvswitch",
        launch_s=0.0,
        hbm_bytes_per_s=1e12,
        async_collectives=True,
        name="toy",
    )
    fields.update(kw)
    return dataclasses.replace(base, **fields)


def test_sync_phase_exposes_and_stale_phase_hides_communication():
    kv = [{"op": "all-gather", "group": 2, "site": "kv", "count": 4, "received_bytes": 0.4e9}]
    w = _workload(kv)  # compute 1 s per step, communication 0.4 s per step
    single = _workload([], flops=2e12, warmup_steps=None)
    hw = _hw()
    p = project(w, single, hw, steps=10, overlap="next-step")
    assert p.warmup_phase_steps == 5 and p.steady_steps == 5
    assert p.phases["warmup"]["exposed_comm_s"] == pytest.approx(0.4)
    assert p.phases["steady"]["exposed_comm_s"] == pytest.approx(0.0)
    assert p.latency_s == pytest.approx(5 * 1.4 + 5 * 1.0)
    assert p.single_latency_s == pytest.approx(20.0)
    assert p.speedup == pytest.approx(20.0 / 12.0)
    # no overlap: everything exposed; a sync strategy: every step is the warm-up program
    assert project(w, single, hw, 10, overlap="none").latency_s == pytest.approx(14.0)
    sync = dataclasses.replace(w, warmup_steps=None)
    assert project(sync, single, hw, 10).latency_s == pytest.approx(14.0)
    # communication longer than a step shows its excess even with the released code's window
    big = _workload([{**kv[0], "received_bytes": 1.5e9}])
    assert project(big, single, hw, 10).phases["steady"]["exposed_comm_s"] == pytest.approx(0.5)
    # a site the step waits for stays exposed in the steady phase (gn=sync)
    gn = [{"op": "all-gather", "group": 2, "site": "gn", "count": 1, "received_bytes": 0.1e9}]
    w2 = _workload(kv + gn, sync_sites=("cfg", "other", "gn"))
    assert project(w2, single, hw, 10).phases["steady"]["exposed_comm_s"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="overlap='sometimes'; known"):
        project(w, single, hw, 10, overlap="sometimes")


def test_patchpars_window_exposes_the_tail_of_the_queue():
    # 4 collectives of 0.1 s issued at 1/8, 3/8, 5/8, 7/8 of a 1 s step: the last one
    # starts at 0.875 s and ends at 0.975 s: nothing exposed; at 0.3 s each the queue ends
    # at max(0.125+0.3, 0.375)+0.3 = 0.725 -> max(0.725, 0.625)+0.3 = 1.025 -> max(1.025, 0.875)+0.3
    # = 1.325 s: 0.325 s exposed. With the next-step window the same 1.2 s of comm shows 0.2 s.
    single = _workload([], warmup_steps=None)
    for each, want_step, want_next in ((0.1e9, 0.0, 0.0), (0.3e9, 0.325, 0.2)):
        kv = [
            {"op": "all-gather", "group": 2, "site": "kv", "count": 4, "received_bytes": 4 * each}
        ]
        w = _workload(kv)
        step = project(w, single, _hw(), 10, overlap="step").phases["steady"]["exposed_comm_s"]
        nxt = project(w, single, _hw(), 10, overlap="next-step").phases["steady"]["exposed_comm_s"]
        assert step == pytest.approx(want_step) and nxt == pytest.approx(want_next)


def test_a_packed_exchange_is_issued_after_its_groups_sites():
    # The same 0.4 s of stale collectives in a 1 s step. Packed in one group they are issued
    # when the step's compute ends: in patchpar's window all of it is exposed. In 4 groups,
    # group g (0.1 s) is issued after g/4 of the compute: groups 1-3 finish under the compute,
    # the last one is issued at the end: 0.1 s exposed. The released code's window hides both.
    single = _workload([], warmup_steps=None)
    kv = [{"op": "all-gather", "group": 2, "site": "kv", "count": 1, "received_bytes": 0.4e9}]
    for groups, count, want in ((1, 1, 0.4), (4, 4, 0.1)):
        w = dataclasses.replace(_workload([{**kv[0], "count": count}]), comm_groups=groups)
        step = project(w, single, _hw(), 10, overlap="step").phases["steady"]["exposed_comm_s"]
        nxt = project(w, single, _hw(), 10, overlap="next-step").phases["steady"]["exposed_comm_s"]
        assert step == pytest.approx(want) and nxt == pytest.approx(0.0)
    # per site (no groups) the four are spread over the step: 1/8, 3/8, 5/8, 7/8 -> none exposed
    per_site = _workload([{**kv[0], "count": 4}])
    assert project(per_site, single, _hw(), 10, overlap="step").phases["steady"][
        "exposed_comm_s"
    ] == pytest.approx(0.0)


def test_launch_cost_and_stale_traffic_are_charged():
    kv = [{"op": "all-gather", "group": 2, "site": "kv", "count": 10, "received_bytes": 0.0}]
    w = _workload(kv, stale=int(1e9))
    p = project(w, _workload([], warmup_steps=None), _hw(launch_s=0.001), 10)
    assert p.phases["steady"]["exposed_comm_s"] == pytest.approx(0.01)
    assert p.phases["steady"]["stale_traffic_s"] == pytest.approx(2e-3)  # read + write at 1 TB/s
    assert p.phases["warmup"]["stale_traffic_s"] == pytest.approx(1e-3)  # written only
    timed = project(
        w,
        _workload([], warmup_steps=None),
        _hw(),
        10,
        measured={"warmup": 2.0, "steady": 3.0, "single": 4.0},
    )
    assert timed.compute_source == "measured" and timed.phases["steady"]["stale_traffic_s"] == 0
    assert timed.latency_s == pytest.approx(5 * 2.0 + 5 * 3.0)
    assert timed.single_latency_s == pytest.approx(40.0)


def test_the_decode_on_one_device_on_row_patches_or_left_out():
    """vae=off adds the whole decode; rows its FLOPs over the devices plus its collectives,
    all exposed; none leaves it out (the papers' latencies). The one-device run decodes on one
    device, or leaves it out with none."""
    w = dataclasses.replace(_workload([]), decode_flops=4e12, encode_flops=1e12, devices=4)
    single = dataclasses.replace(_workload([], warmup_steps=None), decode_flops=4e12,
                                 encode_flops=1e12)  # fmt: skip
    halo = [{"op": "collective-permute", "group": 2, "site": "halo", "count": 3,
             "received_bytes": 0.3e9}]  # fmt: skip
    hw = _hw(collective_latency_s={"all-gather": 0.0, "collective-permute": 0.0})
    off, rows, none = (project(w, single, hw, 10, vae=v, decode_collectives=halo)
                       for v in ("off", "rows", "none"))  # fmt: skip
    assert (off.encode_s, off.decode_s) == pytest.approx((1.0, 4.0))
    assert rows.decode_s == pytest.approx(4.0 / 4 + 0.3)
    assert none.decode_s == 0 and none.other_s == pytest.approx(1.0)
    assert off.latency_s - rows.latency_s == pytest.approx(4.0 - 1.3)
    assert off.single_latency_s == rows.single_latency_s == none.single_latency_s + 4.0
    with pytest.raises(ValueError, match="vae='tiles'; known"):
        project(w, single, hw, 10, vae="tiles")


def test_fit_compute_recovers_its_constants():
    peak, eff, call = 312e12, 0.42, 0.017
    pts = [
        (f, n, f / (peak * eff) + n * call)
        for f, n in ((7e14, 52), (3e15, 52), (1e14, 52), (5e13, 10))
    ]
    e, c = fit_compute(pts, peak)
    assert e == pytest.approx(eff, rel=1e-9) and c == pytest.approx(call, rel=1e-9)
    # points that want a negative overhead get the best efficiency with none
    e, c = fit_compute([(1e12, 1, 1.0), (2e12, 1, 3.0)], 1e12)
    assert c == 0.0 and 1 / e == pytest.approx(15 / 13)  # least squares of x = 1, 2x/3 = 1


# ------------------------------------------------------------------ workloads from programs


def test_workload_matches_the_hlo_count(micro_folder, tmp_path):
    plan = build_plan("sync_patch", {}, 2, 1)
    w = compute_workload(str(micro_folder), 64, plan, 1, "float32")
    from patchpar.lab.costs import CommConfig, run_comm

    rec = run_comm(
        CommConfig.from_flags(
            model=str(micro_folder),
            resolution=64,
            devices=2,
            strategy="sync_patch",
            dtype="float32",
            memory=False,
        )
    )
    for phase, key in (("warmup", "warmup_by_site"), ("steady", "steady_by_site")):
        got = {}
        for g in w.phases[phase]["collectives"]:
            got[g["site"]] = got.get(g["site"], 0) + g["received_bytes"]
        want = {k: v["max"] for k, v in rec[key].items()}
        # on 2 devices a conv's halo is one swap (0 <-> 1), so the busiest receiver of each
        # collective is one device: the groups add up to a device's total
        assert got == want
    assert w.warmup_steps is None and w.stale_bytes_per_device == 0
    assert w.encode_flops > 0 and w.decode_flops > 0  # a folder's own encoder and VAE
    # cached: a second lookup lowers nothing and survives a reload
    cache = WorkloadCache(tmp_path / "w.jsonl")
    a = cache.get(str(micro_folder), 64, plan, 1, "float32")
    b = WorkloadCache(tmp_path / "w.jsonl").get(str(micro_folder), 64, plan, 1, "float32")
    assert a == b and len((tmp_path / "w.jsonl").read_text().splitlines()) == 1


def test_project_cli_every_profile_and_bad_input(micro_folder, tmp_path, capsys):
    args = ["project", "--model", str(micro_folder), "--resolution", "64", "--devices", "2"]
    args += ["--strategy", "distrifusion", "--dtype", "float32", "--steps", "10"]
    args += ["--workloads", str(tmp_path / "w.jsonl")]
    assert main([*args, "--hardware", "all", "--json"]) == 0
    rows = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    assert [r["hardware"] for r in rows] == hardware.names()
    for r in rows:
        assert r["warmup_phase_steps"] == 5 and r["steady_steps"] == 5
        assert math.isclose(r["speedup"], r["single_latency_s"] / r["latency_s"])
        # end to end with the decode on one device (the default) and without it
        assert r["vae"] == "off" and r["latency_s"] == r["latency_decode_one_device_s"]
        assert r["latency_no_decode_s"] <= r["latency_s"]
    assert main([*args, "--hardware", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "| h100-sxm |" in out and "borrowed from a100-sxm" in out
    assert main([*args, "--hardware", "b200"]) == 2
    assert "unknown hardware 'b200'" in capsys.readouterr().err
    bad = [a if a != "64" else "66" for a in args]  # 33 latent rows: no whole units
    assert main([*bad, "--hardware", "a100-sxm"]) == 2
    assert "latent rows=33 are not a multiple of" in capsys.readouterr().err
    assert main([*args[:-2], "--steps", "3", "--hardware", "a100-sxm"]) == 2
    assert "warmup_steps=4 must be < steps=3" in capsys.readouterr().err


def test_workloads_differ_by_data_and_fsdp_and_fsdp_gathers_are_waited_for(tmp_path):
    """A cache line names its mesh: data and FSDP plans are other workloads (lines written
    before either existed read as data 1, no FSDP), and a layer waits for its weights."""
    from patchpar.measure.workload import synchronous_sites

    w = _workload([])
    old = w.to_json()
    del old["data"], old["fsdp"]
    assert Workload.from_json(old).key() == w.key()
    assert dataclasses.replace(w, fsdp=True).key() != w.key()
    assert dataclasses.replace(w, data=2).key() != w.key()
    plan = build_plan("distrifusion", {}, 4, 1, fsdp=True)
    assert "fsdp" in synchronous_sites(plan, "steady")
    assert "fsdp" in synchronous_sites(plan, "warmup")


def test_workload_cache_lives_under_patchpar_home_and_skips_what_does_not_read(
    tmp_path, monkeypatch
):
    """A truncated line (a killed writer before the cache was written atomically) no longer
    breaks every `patchpar project`: it is skipped with a warning naming the file and line; a
    line lowered by another WORKLOAD_VERSION is not served; no temp file is left."""
    from patchpar.measure.workload import WORKLOAD_VERSION, Workload, default_cache_path

    monkeypatch.setenv("PATCHPAR_HOME", str(tmp_path))
    assert default_cache_path() == tmp_path / "workloads.jsonl"
    w = Workload(model="m", resolution=8, strategy="s", devices=2, cfg=1, batch=1,
                 dtype="bfloat16", unet_batch=2, phases={}, synchronous_sites={},
                 stale_bytes_per_device=0, warmup_steps=None, encode_flops=0.0,
                 decode_flops=0.0, version=WORKLOAD_VERSION)  # fmt: skip
    WorkloadCache()._write(w)
    path = default_cache_path()
    older = dataclasses.replace(w, resolution=16, version=0)
    path.write_text(path.read_text() + '{"model": "m", "resol\n' + json.dumps(older.to_json()))
    with pytest.warns(UserWarning, match=r"workloads.jsonl:2: not a workload"):
        cache = WorkloadCache()
    assert [x.resolution for x in cache] == [8]
    cache._write(dataclasses.replace(w, resolution=32))  # appends after an unterminated line
    assert len(path.read_text().splitlines()) == 4
    assert not list(tmp_path.glob(".workloads-*"))


def test_a_stride_two_workload_runs_the_model_on_the_odd_steady_steps():
    """AsyncDiff stride 2: one round (the steady program) per two steps, on the odd steps
    after warm-up; a warm-up of an even number of steps leaves one more step without the
    model. Sync offset 0: warmup_steps exact steps."""
    single = _workload([], flops=2e12, warmup_steps=None)
    # the odd steps of [4, 10): 5 7 9; of [5, 10): 5 7 9; of [6, 10): 7 9
    for warm, rounds in ((4, 3), (5, 3), (6, 2)):
        w = dataclasses.replace(_workload([], warmup_steps=warm), sync_offset=0, step_stride=2)
        p = project(w, single, _hw(), 10, overlap="none")
        assert p.warmup_phase_steps == warm and p.steady_steps == 10 - warm
        assert p.latency_s == pytest.approx(warm * 1.0 + rounds * 1.0)


def test_compact_waits_for_its_compressed_exchange_and_stale_compression_does_not():
    """compact exchanges fresh (compressed) halos and K/V: the steady step waits for them;
    a stale strategy's compressed sends overlap as uncompressed ones do."""
    from patchpar.lab.config import build_plan
    from patchpar.measure.workload import synchronous_sites

    compact = synchronous_sites(
        build_plan("compact", {"codec": "kv=int2,halo=int2"}, 4, 1), "steady"
    )
    assert {"kv", "halo", "gn"} <= set(compact)
    stale = synchronous_sites(build_plan("distrifusion", {"codec": "int2"}, 4, 1), "steady")
    assert not {"kv", "halo", "gn"} & set(stale)
