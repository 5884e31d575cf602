"""The guide's commands (README and the docs it links) hold on a fresh clone: every `patchpar`
command in it parses and passes the checks it makes before any work, a command that reads what
an earlier run writes (`runs/X`) comes after the command that makes it, the library snippets
run as written, and the hardware list is the profiles'. The slow tier runs every command at
miniature scale."""

import dataclasses
import shlex
from pathlib import Path

import pytest
import tyro
import yaml

from patchpar.lab import cli
from patchpar.lab.calibrate import CalibrateConfig
from patchpar.lab.calibrate import check as check_calibrate
from patchpar.lab.config import RunConfig
from patchpar.lab.costs import CommConfig, check_comm
from patchpar.lab.generate import GenerateConfig, check
from patchpar.lab.plots import PlotConfig
from patchpar.lab.project import ProjectConfig, check_project
from patchpar.lab.sweep import SweepConfig, load_sweep
from patchpar.lab.tables import TableConfig

ROOT = Path(__file__).resolve().parents[1]
# the user's guide: README, then the guides it links, in the order a reader meets them (a
# command that reads what an earlier one writes must come after it in this order)
GUIDE_FILES = ("README.md", "docs/concepts.md", "docs/usage.md", "docs/models.md",
               "docs/hardware.md")  # fmt: skip
README = "\n".join((ROOT / f).read_text() for f in GUIDE_FILES)


def blocks(language: str) -> list[str]:
    out, inside, lines = [], False, []
    for line in README.splitlines():
        if line.startswith("```"):
            if inside:
                out.append("\n".join(lines))
            inside, lines = line == f"```{language}", []
        elif inside:
            lines.append(line)
    return out


def commands() -> list[list[str]]:
    """Every `patchpar ...` command of README's bash blocks, as argv (continuations joined,
    comments dropped), in order."""
    out = []
    for block in blocks("bash"):
        for cmd in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(cmd, comments=True)
            if argv and argv[0] == "patchpar":
                out.append(argv[1:])
    return out


def parse(argv: list[str]):
    argv = cli._short_flags(argv)
    if argv[0] == "run":
        return cli._run_config(argv[1:])
    return tyro.extras.subcommand_cli_from_dict(cli._subcommands(), prog="patchpar", args=argv)


def made_by(config) -> str | None:
    """The `runs/X` folder a command writes records to (None: it writes none)."""
    if isinstance(config, SweepConfig) and not config.dry_run:
        point = load_sweep(ROOT / config.file, config.results)[0]
        return str(Path(point.results) / point.experiment)
    if isinstance(config, RunConfig):
        return str(Path(config.results) / config.experiment)
    return None


def test_every_readme_command_parses_passes_its_checks_and_follows_what_it_reads(monkeypatch):
    monkeypatch.chdir(ROOT)
    found = commands()
    assert {a[0] for a in found} >= {"run", "sweep", "table", "plot", "generate", "comm",
                                     "project"}  # fmt: skip
    made: set[str] = set()
    for argv in found:
        config = parse(argv)
        if isinstance(config, RunConfig):
            config.validate()
        elif isinstance(config, GenerateConfig):
            check(config)
        elif isinstance(config, CommConfig):
            check_comm(config)
        elif isinstance(config, CalibrateConfig):
            check_calibrate(config)
        elif isinstance(config, ProjectConfig):
            if config.timings is not None:  # made by README's device suite (run_all.sh)
                assert str(config.timings).startswith("results/device/")
                assert "bash experiments/device/run_all.sh" in README
            check_project(dataclasses.replace(config, timings=None))
        if isinstance(config, TableConfig | PlotConfig):
            for path in config.results:
                assert Path(path).exists() or str(path) in made, (
                    f"`patchpar {' '.join(argv)}` reads {path}, which no earlier README command "
                    f"makes and a fresh clone lacks"
                )
        if (where := made_by(config)) is not None:
            made.add(where)


def test_the_library_snippets_run_as_written(monkeypatch):
    monkeypatch.chdir(ROOT)
    snippets = blocks("python")
    assert len(snippets) >= 2
    for code in snippets:
        exec(compile(code, "README.md", "exec"), {})


def test_the_hardware_list_is_the_profiles():
    from patchpar import hardware

    sentence = README[README.index("profiles: `") :].split(")")[0]
    named = sentence.split("`")[1::2]
    assert named == sorted(p.name for p in hardware.load_all())


# ---------------------------------------------------------------------------- miniature

MODELS = {"sdxl": "tiny-xl", "sd15": "tiny", "pixart-alpha": "tiny-dit"}
POINT = {"sampler.steps": 6, "measure.repeats": 1, "measure.warmup_runs": 0,
         "prompts.seeds": [0], "prompts.batch_size": 0}  # fmt: skip


def miniature_sweep(file: Path, tmp: Path) -> Path:
    """The sweep with at most two points per list, six steps, one seed, one timed repeat."""
    spec = yaml.safe_load(file.read_text())
    spec.setdefault("experiment", file.stem)
    if spec.get("base"):
        spec["base"] = str((file.parent / spec["base"]).resolve())
    spec["set"] = {**(spec.get("set") or {}), **POINT}
    if spec.get("points"):
        spec["points"] = spec["points"][:2]
    grids = spec.get("grid") or {}
    grids = [
        {k: v[:2] for k, v in g.items()} for g in (grids if isinstance(grids, list) else [grids])
    ]
    spec["grid"] = grids[:2]
    out = tmp / "sweeps" / file.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(spec))
    return out


def miniature(argv: list[str], tmp: Path) -> list[str]:
    """A README command at miniature scale: small models and images, six steps, nothing
    written into results/."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else None
        if a == "--model" and value in MODELS:
            out += [a, MODELS[value]]
        elif a == "--resolution":
            out += [a, "256"]
        elif a == "--steps":
            out += [a, "6"]
        elif a == "--results" and value == "results":
            out += [a, str(tmp / "published")]
        elif a.endswith(".yaml") and "sweeps" in a:
            out.append(str(miniature_sweep(ROOT / a, tmp)))
            i += 1
            continue
        else:
            out.append(a)
            i += 1
            continue
        i += 2
    if out[0] == "generate" and "--steps" not in out:
        out += ["--steps", "6"]
    if out[0] == "run":
        out += ["--sampler.steps", "6", "--measure.repeats", "1", "--measure.warmup-runs", "0"]
    if out[0] == "project":
        out += ["--workloads", str(tmp / "workloads.jsonl")]
    return out


@pytest.mark.slow
def test_every_readme_command_runs_in_miniature(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name in ("experiments", "results", "patchpar"):
        (tmp_path / name).symlink_to(ROOT / name)
    for argv in commands():
        if argv[0] == "project" and "--timings" in argv:  # needs a GPU machine's timings
            continue
        small = miniature(argv, tmp_path)
        code = cli.main(small)
        err = capsys.readouterr().err
        assert code == 0, f"patchpar {' '.join(small)}: exit {code}\n{err[-2000:]}"
