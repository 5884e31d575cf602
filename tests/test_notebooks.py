"""The paper-artefact notebooks (experiments/notebooks/table1_quality, table2_communication,
ablations, flux_study, caches, quant, video_study) execute with nbclient on the committed
records, read records only, and draw their figures; they run on a copy of the records so the
committed figures stay as they are."""

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
NOTEBOOKS = REPO / "experiments" / "notebooks"
ABLATIONS = ("fmnist_groupnorm", "fmnist_warmup", "fmnist_portion", "fmnist_baselines")


def run_on_records(tmp_path, monkeypatch, run_notebook, notebook: str, *experiments: str):
    """Run experiments/notebooks/<notebook>.ipynb on a copy of the experiments' records under
    tmp_path: (the experiments that had records, the printed text)."""
    found = copy_records(tmp_path, *experiments)
    monkeypatch.setenv("PATCHPAR_RESULTS_ROOT", str(tmp_path))
    text, _ = run_notebook(NOTEBOOKS / f"{notebook}.ipynb")
    return found, text


def copy_records(root: Path, *experiments: str) -> list[str]:
    """Copy results/<experiment>/runs.jsonl under root; the experiments that had records."""
    found = []
    for name in experiments:
        src = RESULTS / name / "runs.jsonl"
        if src.is_file():
            (root / name).mkdir(parents=True)
            shutil.copy(src, root / name / "runs.jsonl")
            found.append(name)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not (RESULTS / "comm" / "runs.jsonl").is_file(), reason="no comm records")
def test_table2_communication_notebook(tmp_path, monkeypatch, run_notebook):
    copy_records(tmp_path, "comm")
    monkeypatch.setenv("PATCHPAR_RESULTS_ROOT", str(tmp_path))
    text, _ = run_notebook(NOTEBOOKS / "table2_communication.ipynb")
    assert "| sdxl | 3840 | 8 |" in text
    assert (tmp_path / "comm" / "plots" / "table2_communication.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(
    not (RESULTS / "fmnist_quality" / "runs.jsonl").is_file(), reason="no fmnist_quality records"
)
def test_table1_quality_notebook(tmp_path, monkeypatch, run_notebook):
    found = copy_records(tmp_path, "fmnist_quality", "fmnist_dit_quality")
    monkeypatch.setenv("PATCHPAR_RESULTS_ROOT", str(tmp_path))
    text, _ = run_notebook(NOTEBOOKS / "table1_quality.ipynb")
    assert "| single | 1 | ∞ (identical) |" in text and "| pcpp send=band | 8 |" in text
    assert (tmp_path / "fmnist_quality" / "plots" / "table1_quality.png").stat().st_size > 0
    if "fmnist_dit_quality" in found:  # the DiT's table, figure and the beside-xDiT ratios
        assert "| pipefusion | 8 |" in text and "pipefusion: ours" in text
        for name in ("table1_quality_dit", "fid_vs_xdit"):
            assert (tmp_path / "fmnist_dit_quality" / "plots" / f"{name}.png").stat().st_size > 0


@pytest.mark.slow
def test_ablations_notebook(tmp_path, monkeypatch, run_notebook):
    found = copy_records(tmp_path, *ABLATIONS)
    monkeypatch.setenv("PATCHPAR_RESULTS_ROOT", str(tmp_path))
    text, _ = run_notebook(NOTEBOOKS / "ablations.ipynb")
    plots = {
        "fmnist_groupnorm": "groupnorm",
        "fmnist_warmup": "warmup",
        "fmnist_portion": "portion_frontier",
        "fmnist_baselines": "baselines",
    }
    for name in ABLATIONS:
        png = tmp_path / name / "plots" / f"{plots[name]}.png"
        if name in found:
            assert png.stat().st_size > 0
        else:
            assert f"{name}: no records" in text and not png.exists()


@pytest.mark.skipif(
    not (RESULTS / "fmnist_flux_quality" / "runs.jsonl").is_file(),
    reason="no fmnist_flux_quality records",
)
@pytest.mark.slow  # three notebooks stay in the default tier
def test_flux_study_notebook(tmp_path, monkeypatch, run_notebook):
    """The MMDiT study: its table, the three-model figure (UNet, DiT, MMDiT), the ablations'
    figures where their records exist."""
    found = copy_records(
        tmp_path,
        "fmnist_flux_quality",
        "fmnist_flux_ablations",
        "fmnist_quality",
        "fmnist_dit_quality",
    )
    monkeypatch.setenv("PATCHPAR_RESULTS_ROOT", str(tmp_path))
    text, _ = run_notebook(NOTEBOOKS / "flux_study.ipynb")
    assert (
        "| single | 1 | ∞ (identical) |" in text
        and "| fmnist-flux (MMDiT) | distrifusion |" in text
    )
    assert (tmp_path / "fmnist_flux_quality" / "plots" / "three_models.png").stat().st_size > 0
    for name in ("warmup_steps", "text_codecs"):
        png = tmp_path / "fmnist_flux_ablations" / "plots" / f"{name}.png"
        if "fmnist_flux_ablations" in found:
            assert png.stat().st_size > 0
        else:
            assert "fmnist_flux_ablations: no records" in text and not png.exists()


CACHES = ("cache_fmnist_dit", "cache_fmnist", "cache_fmnist_flux", "speedup_cache_fmnist_dit",
          "speedup_cache_fmnist", "asyncdiff_fmnist_dit", "asyncdiff_fmnist",
          "asyncdiff_fmnist_flux", "speedup_asyncdiff", "speedup_asyncdiff_fmnist",
          "speedup_deepcache_fmnist", "asyncdiff_stride_fmnist_dit", "teacache_fmnist_dit",
          "speedup_teacache_fmnist_dit")  # fmt: skip


@pytest.mark.skipif(
    not (RESULTS / "cache_fmnist_dit" / "runs.jsonl").is_file(), reason="no step-cache records"
)
@pytest.mark.slow  # three notebooks stay in the default tier
def test_caches_notebook(tmp_path, monkeypatch, run_notebook):
    found, text = run_on_records(tmp_path, monkeypatch, run_notebook, "caches", *CACHES)
    assert "| distrifusion + fbcache threshold=0.1 |" in text
    if "asyncdiff_fmnist_dit" in found:
        assert "| asyncdiff warmup_steps=9 | 2 |" in text
    for name in found:
        plot = "speedup" if name.startswith("speedup") else "psnr_vs_blocks_computed"
        plot = "psnr_vs_bytes" if name.startswith("asyncdiff") else plot
        assert (tmp_path / name / "plots" / f"{plot}.png").stat().st_size > 0
    if "asyncdiff_stride_fmnist_dit" in found:
        assert "| asyncdiff warmup_steps=9 stride=2 | 4 |" in text


@pytest.mark.skipif(
    not (RESULTS / "quant_fmnist_dit" / "runs.jsonl").is_file(), reason="no quant records"
)
@pytest.mark.slow  # three notebooks stay in the default tier
def test_quant_notebook(tmp_path, monkeypatch, run_notebook):
    """Quantization under patch parallelism: the mode x strategy table and figures."""
    found = copy_records(
        tmp_path, "quant_fmnist_dit", "quant_fmnist_flux", "quant_speed_fmnist_dit"
    )
    monkeypatch.setenv("PATCHPAR_RESULTS_ROOT", str(tmp_path))
    text, _ = run_notebook(NOTEBOOKS / "quant.ipynb")
    assert "| strategy | none | w8 | w4 | int8 | fp8 |" in text and "| distrifusion |" in text
    for name in found:
        plot = "quant_speed" if "speed" in name else "quant_quality"
        assert (tmp_path / name / "plots" / f"{plot}.png").stat().st_size > 0


VIDEO = ("video_key", "video_layouts", "video_warmup", "video_methods", "speedup_cpu_video")


@pytest.mark.skipif(
    not (RESULTS / "speedup_cpu_video" / "runs.jsonl").is_file(), reason="no video records"
)
@pytest.mark.slow  # three notebooks stay in the default tier
def test_video_study_notebook(tmp_path, monkeypatch, run_notebook):
    """The video study: its tables, and each figure where its sweep has records."""
    found, text = run_on_records(tmp_path, monkeypatch, run_notebook, "video_study", *VIDEO)
    assert "| single | — |" in text and "| pcpp send=band | rows |" in text  # the speed table
    if "video_key" in found:
        assert "| distrifusion | 4 | rows |" in text
    plots = {"video_key": "psnr_by_frame", "video_layouts": "layouts", "video_warmup": "warmup"}
    for name, plot in plots.items():
        png = tmp_path / name / "plots" / f"{plot}.png"
        if name in found:
            assert png.stat().st_size > 0
        else:
            assert f"{name}: no records" in text and not png.exists()
