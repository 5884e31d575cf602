"""What the `patchpar` commands tell a user: where `plot` writes (never into the published
results/ unless named), warnings as one line, `--help` naming every registered entry, and
`generate` saying what it read from disk (the compile cache, a quantized checkpoint)."""

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest

from patchpar.lab.cli import main
from patchpar.lab.results import published

REPO = Path(__file__).resolve().parents[1]


def _records(folder: Path, devices: int) -> Path:
    """A results folder with one ok run record (no images)."""
    folder.mkdir(parents=True)
    record = {
        "run_id": f"r{devices}",
        "label": "sync_patch",
        "status": "ok",
        "config": {"mesh": {"devices": devices}, "strategy": {"name": "sync_patch"}},
        "metrics": {"bytes_per_device_per_step": 2.0**20, "psnr": 30.0},
    }
    (folder / "runs.jsonl").write_text(json.dumps(record) + "\n")
    return folder


def test_plot_of_several_folders_writes_outside_them_and_says_where(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    a, b = _records(tmp_path / "runs" / "a", 2), _records(tmp_path / "results" / "a", 4)
    assert main(["plot", str(a), str(b)]) == 0
    out = Path("runs/plots/runs-a+results-a")  # same names: told apart by their parents
    assert (out / "bytes_vs_devices.png").is_file()
    assert not (a / "plots").exists() and not (b / "plots").exists()
    assert capsys.readouterr().out.splitlines()[-1] == f"plots -> {out}"
    # one folder: its plots/, as before; --out: where it says
    assert main(["plot", str(a)]) == 0
    assert (a / "plots" / "bytes_vs_devices.png").is_file()
    assert main(["plot", str(a), str(b), "--out", "mine"]) == 0
    assert (tmp_path / "mine" / "bytes_vs_devices.png").is_file()
    assert capsys.readouterr().out.splitlines()[-1] == "plots -> mine"


def test_plot_never_writes_into_the_published_results_unless_named(tmp_path, capsys):
    folder = REPO / "results" / "fmnist_groupnorm"
    assert (folder / "runs.jsonl").is_file() and published(folder / "plots")
    assert not published(tmp_path / "results" / "x")  # only this checkout's results/
    before = sorted(folder.rglob("*"))
    assert main(["plot", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --out" in err and "published" in err, err
    assert sorted(folder.rglob("*")) == before  # nothing written


def test_generate_help_names_every_registered_entry(capsys, monkeypatch):
    from patchpar.models.family import families
    from patchpar.models.presets import SHIPPED, WEIGHTED
    from patchpar.parallel.codecs import NAMES
    from patchpar.parallel.strategies import STRATEGIES
    from patchpar.sampling.cache import CACHES
    from patchpar.sampling.schedulers import SAMPLERS

    monkeypatch.setenv("COLUMNS", "400")  # one line per option's help: no word cut in two
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    pipelines = [
        c.removesuffix("Pipeline") for f in families().values() for c in f.pipeline_classes
    ]
    names = [*STRATEGIES, *SAMPLERS, *CACHES, *SHIPPED, *WEIGHTED, *pipelines, *NAMES]
    missing = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
    assert not missing, missing


def test_warnings_are_one_line_and_still_raised(tmp_path, micro_folder, capfd):
    """An int8 model on a CPU warns that its products are emulated (when it is quantized, before
    the plan is checked: int8 refuses tensor parallelism, so nothing compiles): shown as one line
    `patchpar: warning: ...`, not Python's `file:line: UserWarning` and source line; still a
    warning that pytest.warns records, and an error under `-W error`."""
    args = ["generate", "--model", str(micro_folder), "--quant", "int8", "--strategy", "tensor",
            "--devices", "2", "--steps", "1", "--out", str(tmp_path / "gen")]  # fmt: skip
    with pytest.warns(UserWarning, match=r"quant='int8': emulated"):
        assert main(args) == 2
    err = capfd.readouterr().err
    line = next(ln for ln in err.splitlines() if "emulated" in ln)
    assert line.startswith("patchpar: warning: quant='int8': emulated: cpu"), line
    assert "UserWarning" not in err and "warnings.warn(" not in err, err
    assert "patchpar: error: tensor parallelism over 2 devices" in err
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # `python -W error`: raised, not shown
        assert main(args) == 1
    err = capfd.readouterr().err
    assert "patchpar: error: UserWarning: quant='int8': emulated" in err
    assert warnings.showwarning is warnings._showwarning_orig  # the hook is gone after


def test_generate_says_what_it_read_from_disk(tmp_path, micro_folder, capfd):
    """`generate` names the quantized checkpoint it read, and how many programs it read from
    the compile cache (and where) against how many it compiled (`compile_cache.hits`,
    `compiled`: counted in two processes in test_compile_cache.py)."""
    from patchpar import compile_cache
    from patchpar.pipelines import load_pipeline

    folder = tmp_path / "model"
    shutil.copytree(micro_folder, folder)
    checkpoint = load_pipeline(folder, quant="w8").save_quantized()
    before = compile_cache.hits(), compile_cache.compiled()
    args = ["generate", "--model", str(folder), "--quant", "w8", "--steps", "1", "--height", "32",
            "--out", str(tmp_path / "gen")]  # fmt: skip
    assert main(args) == 0
    read, compiled = compile_cache.hits() - before[0], compile_cache.compiled() - before[1]
    err = capfd.readouterr().err
    assert f"\nread quantized checkpoint {checkpoint}\n" in err
    where = compile_cache.enable()  # the session's cache (tests/conftest.py), unless off
    line = f"{read} program(s) read from the compile cache ({where}), {compiled} compiled\n"
    if compile_cache.disabled():
        assert where is None and "compile cache" not in err
    else:
        assert where is not None and line in err and read + compiled >= 1, err
    record = json.loads((tmp_path / "gen" / "generate.json").read_text())
    assert record["quant_checkpoint"] == str(checkpoint) and record["compile_cache_hits"] == read
