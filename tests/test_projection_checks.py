"""The committed latency checks re-derived from their records: DistriFusion's paper check
(a100-sxm's fitted constants and every published point's projection), xDiT's check and the
predictions on other hardware, and the latency notebook on the committed records."""

import json
from pathlib import Path

import pytest

from patchpar import hardware
from patchpar.measure.projection import fit_compute, project
from patchpar.measure.workload import WorkloadCache

REPO = Path(__file__).resolve().parent.parent
LATENCY = REPO / "results" / "latency"


def _experiment(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not (LATENCY / "paper.jsonl").is_file(), reason="no paper check committed")
def test_paper_check_rederived_from_its_records(monkeypatch):
    """a100-sxm's stored constants are the fit of the committed workloads on the declared
    points, and every published point's projection follows from them."""
    from patchpar.measure import workload

    def not_cached(*args):
        raise AssertionError(f"workload {args[:2]} missing from the committed cache")

    monkeypatch.setattr(workload, "compute_workload", not_cached)
    paper = _experiment("latency_paper")
    wl = paper.workloads(WorkloadCache(LATENCY / "workloads.jsonl"))
    hw = hardware.load("a100-sxm")
    pts = paper.fit_points(wl, hw.peak_flops, hw.hbm_bytes_per_s)
    assert len(pts) == 6 and {p[3][1] for p in pts} == set(paper.FIT_METHODS)
    eff, call = fit_compute([p[:3] for p in pts], hw.peak_flops)
    assert hw.flop_efficiency == pytest.approx(eff, abs=1e-4)
    assert hw.call_overhead_s == pytest.approx(call, abs=1e-6)
    rows = [json.loads(line) for line in (LATENCY / "paper.jsonl").read_text().splitlines()]
    assert len(rows) == len(paper.PUBLISHED)
    for r in rows:
        single = wl[("single", r["resolution"], 1)]
        if r["method"] == "original":
            w = single
        elif r["method"] == "no communication":
            w = paper.no_comm(wl[("distrifusion", r["resolution"], r["gpus"])])
        else:
            w = wl[(r["method"], r["resolution"], r["gpus"])]
        p = project(w, single, hw, paper.STEPS, vae=paper.VAE)
        assert p.latency_s == pytest.approx(r["projected_s"], rel=1e-3), r
        assert r["error"] == pytest.approx(r["projected_s"] / r["published_s"] - 1)


XDIT = REPO / "results" / "latency_xdit"


@pytest.mark.skipif(not (XDIT / "xdit.jsonl").is_file(), reason="no xDiT check committed")
def test_xdit_check_rederived_from_its_workloads(tmp_path, monkeypatch, capsys):
    """Every projected PixArt-α latency beside xDiT's follows from the committed workloads and
    the stored a100 constants (nothing fitted on these points), PipeFusion's among them; so do
    the predictions on other hardware."""
    import shutil

    from patchpar.measure import workload

    def not_cached(*args):
        raise AssertionError(f"workload {args[:2]} missing from the committed cache")

    monkeypatch.setattr(workload, "compute_workload", not_cached)
    shutil.copy(XDIT / "workloads.jsonl", tmp_path / "workloads.jsonl")
    xdit = _experiment("latency_xdit")
    assert xdit.main(["--out", str(tmp_path)]) == 0
    ours = [json.loads(line) for line in (tmp_path / "xdit.jsonl").read_text().splitlines()]
    committed = [json.loads(line) for line in (XDIT / "xdit.jsonl").read_text().splitlines()]
    assert len(ours) == len(committed) == 3 * (len(xdit.ONE_GPU) + len(xdit.PUBLISHED))
    for a, b in zip(ours, committed, strict=True):
        assert (a["setup"], a["method"], a["resolution"]) == (
            b["setup"],
            b["method"],
            b["resolution"],
        )
        assert a["projected_s"] == pytest.approx(b["projected_s"], rel=1e-6), b
    assert {r["method"] for r in ours} >= {"pipefusion", "distrifusion"}
    preds = [(tmp_path / "predictions.jsonl"), (XDIT / "predictions.jsonl")]
    ours, committed = ([json.loads(x) for x in f.read_text().splitlines()] for f in preds)
    assert len(ours) == len(committed) > 0
    for a, b in zip(ours, committed, strict=True):
        assert a["latency_s"] == pytest.approx(b["latency_s"], rel=1e-6), b
    assert "median absolute error" in capsys.readouterr().out


@pytest.mark.skipif(not (LATENCY / "paper.jsonl").is_file(), reason="no paper check committed")
@pytest.mark.slow
def test_latency_notebook_executes(tmp_path, monkeypatch, run_notebook):
    """experiments/notebooks/latency.ipynb reads the committed records only and draws its plots
    (into a copy of the records folder here, so the committed figures stay as they are)."""
    import shutil

    for name in ("paper.jsonl", "predictions.jsonl", "cpu.jsonl"):
        shutil.copy(LATENCY / name, tmp_path / name)
    monkeypatch.setenv("PATCHPAR_LATENCY", str(tmp_path))
    text, _ = run_notebook(REPO / "experiments" / "notebooks" / "latency.ipynb")
    assert "21 published points (15 checks)" in text and "cpu: 16 points" in text
    for png in ("paper_vs_projected", "projected_speedup_by_hardware", "cpu_projected_vs_measured"):
        assert (tmp_path / "plots" / f"{png}.png").stat().st_size > 0
