"""No option is silently ignored, and every message names what fits: the cases a newcomer's
audit found (each with its one-line message), and progress on long waits."""

import json

import pytest

from patchpar.lab.cli import main
from patchpar.lab.config import RunConfig, unused_options
from patchpar.lab.configio import with_overrides


def exit_code(args: list[str]) -> int:
    """`patchpar args`'s exit code (a command-line error exits through SystemExit)."""
    try:
        return main(args)
    except SystemExit as e:
        return e.code


def one_error(capsys) -> str:
    """The command's one error line (progress lines may come before it)."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if ln.startswith("patchpar: error")]
    assert len(errors) == 1 and err[-1] == errors[0], err
    return errors[0]


def test_a_tile_size_without_tiles_is_an_error(tmp_path, capsys):
    assert main(["generate", "--vae-tile", "64", "--out", str(tmp_path)]) == 2
    assert "vae_tile=64: a tile size is for vae_parallel=tiles" in one_error(capsys)
    with pytest.raises(ValueError, match=r"mesh.vae_tile=64: a tile size is for"):
        with_overrides(RunConfig(), {"mesh.vae_tile": 64}).validate()


def test_comm_has_no_vae_flags_and_a_codec_names_a_kind_once(capsys):
    assert exit_code(["comm", "--model", "tiny", "--vae-parallel", "rows"]) == 2
    err = one_error(capsys)
    assert "options: --vae-parallel rows (not options of patchpar comm)" in err
    assert "did you mean --vae-parallel (patchpar generate, project, run)?" in err
    args = ["comm", "--model", "tiny", "--resolution", "256", "--strategy", "distrifusion",
            "--devices", "2", "--codec", "kv=int2,kv=int8"]  # fmt: skip
    assert main(args) == 2
    assert "codec='kv=int2,kv=int8' names site kind 'kv' twice" in one_error(capsys)


def test_project_prices_no_decode_for_a_pixel_space_model(tmp_path, capsys):
    base = ["project", "--model", "fmnist-dit", "--resolution", "32", "--devices", "2",
            "--strategy", "distrifusion", "--workloads", str(tmp_path / "w.jsonl")]  # fmt: skip
    assert main([*base, "--vae-parallel", "rows"]) == 2
    assert "works in pixel space (no VAE), so there is no decode to place" in one_error(capsys)
    assert main([*base, "--json"]) == 0
    out = capsys.readouterr().out
    row = json.loads(out.splitlines()[-1])
    assert row["pixel_space"] and row["decode_s"] == 0 and row["decode_one_device_s"] == 0
    assert row["encode_s"] > 0  # the folder's own T5 encoder is priced, not a bare call


def test_a_bad_timeout_is_refused_before_any_worker_starts(tmp_path, capsys):
    args = ["generate", "--devices", "2", "--processes", "2", "--timeout-s", "-5",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "timeout_s=-5.0: must be a positive number of seconds" in err
    assert "launching" not in err and "[rank" not in err


def test_a_link_to_nothing_is_no_place_to_write(tmp_path):
    from patchpar.lab.results import check_writable

    (tmp_path / "runs").symlink_to(tmp_path / "absent")
    with pytest.raises(ValueError, match="runs' is a link to nothing"):
        check_writable(tmp_path / "runs" / "x", "results")
    assert check_writable(tmp_path / "new" / "x", "results") and not (tmp_path / "new").exists()


def test_a_metrics_inputs_are_checked_before_anything_and_nothing_is_left(tmp_path, capsys):
    args = ["run", "--model.name", "fmnist", "--measure.quality", "fid_gt",
            "--measure.ground-truth", str(tmp_path / "missing"), "--prompts.seeds", "0", "1",
            "--results", str(tmp_path / "rec")]  # fmt: skip
    assert main(args) == 2
    assert "measure.ground_truth=" in one_error(capsys)
    assert not (tmp_path / "rec").exists()  # a run that fails its checks makes no folder


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--steps", "2.5"], "--steps='2.5': expected an integer"),
        (["run", "--prompts.seeds", "[0]"],
         "--prompts.seeds='[0]': expected integers separated by spaces (e.g. `0 1 2`), not a "
         "bracketed list"),
        (["comm", "--model", "pixart-alfa"],
         "model 'pixart-alfa' is neither a preset ("),
        (["comm", "--model", "pixart-alfa"], "did you mean pixart-alpha"),
        (["generate", "--no-sync", "maybe"],
         "--no-sync='maybe': expected no value (a bare flag) or True or False"),
        (["generate", "--strategy", "distrifusion", "--devices", "2", "--no-sync"],
         "no_sync=True exchanges nothing after warm-up"),
    ],
)  # fmt: skip
def test_messages_name_the_type_or_the_known_names(args, message, capsys):
    assert exit_code(args) == 2
    assert message in one_error(capsys)


def test_group_by_an_unknown_key_says_what_keys_look_like(capsys):
    assert main(["table", "results/fmnist_groupnorm", "--group-by", "foo"]) == 2
    err = one_error(capsys)
    assert "--group-by 'foo': no record has this key; keys are dotted paths such as" in err


def test_no_sync_is_a_bare_flag():
    from patchpar.lab.cli import _run_config

    cfg = _run_config(["--strategy.name", "distrifusion", "--strategy.no-sync"])
    assert cfg.strategy.no_sync is True
    assert _run_config(["--strategy.no-sync", "False"]).strategy.no_sync is False
    assert _run_config([]).strategy.no_sync is None  # unset: the strategy's default


def test_options_without_effect_are_warned_of_and_recorded(tmp_path, capsys):
    cfg = with_overrides(
        RunConfig(),
        {
            "model.attention": "xla",
            "model.block_q": 64,
            "measure.ground_truth": "fashion-mnist:train",
            "measure.lpips_net": "vgg",
            "timeout_s": 60.0,
            "prompts.batch_size": 4,
        },
    )
    unused = unused_options(cfg)
    assert len(unused) == 5
    assert "model.block_q=64 has no effect with model.attention='xla'" in unused[0]
    assert any("measure.lpips_net='vgg' has no effect" in u and "lpips" in u for u in unused)
    assert any("timeout_s=60.0 has no effect without mesh.processes" in u for u in unused)
    assert any("prompts.batch_size=4 is more than the 1 image(s)" in u for u in unused)
    assert unused_options(RunConfig()) == []  # defaults have nothing to miss
    # the shipped configs' spelling of the default reference is the default
    same = with_overrides(RunConfig(), {"measure.ground_truth": "fashion-mnist:test"})
    assert unused_options(same) == []
    one = with_overrides(RunConfig(), {"mesh.fsdp": True})
    assert unused_options(one) == [
        "fsdp has no effect on 1 device(s) here: no two devices run the same weights (one "
        "device, or tensor parallelism over all of them), so there is nothing to shard"
    ]
    compute = with_overrides(RunConfig(), {"measure.compute_only": True})
    assert "is not measured with measure.compute_only" in unused_options(compute)[0]
    # printed once, kept in the record
    args = ["run", "--model.name", "fmnist", "--sampler.steps", "2", "--measure.repeats", "1",
            "--measure.quality", "psnr", "--measure.lpips-net", "vgg", "--experiment", "w",
            "--results", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert err.count("patchpar: warning: measure.lpips_net='vgg' has no effect") == 1
    rec = json.loads((tmp_path / "w" / "runs.jsonl").read_text().splitlines()[-1])
    assert rec["warnings"] == [
        "measure.lpips_net='vgg' has no effect: measure.quality ['psnr'] does not include lpips"
    ]


def test_a_cache_option_past_the_last_step_is_warned_of():
    """taylorseer's stop at or after the run's last step never comes (the run is the one
    without it): a warning in `run` and `generate`, not silence; a stop inside the run is not
    (after a warm-up of one step: with taylorseer's default of 3, stop=3 of 4 steps predicts
    none, an error)."""
    from patchpar.lab.generate import GenerateConfig, check

    base = {"model.name": "fmnist-dit", "cache.name": "taylorseer", "sampler.steps": 4,
            "cache.warmup": 1}  # fmt: skip
    for stop, warned in ((100, True), (4, True), (3, False)):
        cfg = with_overrides(RunConfig(), {**base, "cache.stop": stop})
        want = [f"cache stop={stop} has no effect with 4 steps: the last step is 3, so caching "
                f"never stops (as unset); use stop <= 3"]  # fmt: skip
        assert unused_options(cfg) == (want if warned else [])
        gen = GenerateConfig.from_flags(
            model="fmnist-dit", steps=4, cache="taylorseer", cache_stop=stop, cache_warmup=1
        )
        assert check(gen) == (want if warned else [])


def test_project_checks_a_cache_against_its_steps(capsys):
    """`project` checks the cache against the projected run's steps before lowering anything
    (it lowers with the step count open), as run and generate do."""
    args = ["project", "--model", "fmnist-dit", "--cache", "fbcache", "--steps", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "fbcache(threshold=0.05) with 1 steps: every step computes" in err


@pytest.mark.slow
def test_generate_reports_each_stage_as_it_starts(tmp_path, micro_folder, capsys):
    args = ["generate", "--model", str(micro_folder), "--strategy", "distrifusion", "--devices",
            "2", "--steps", "3", "--warmup-steps", "0", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    for line in ("loading ", "encoding 1 prompt(s)", "warm-up phase: compiling (steps 1-1 of 3)",
                 "warm-up phase: running steps 1-1 of 3", "steady phase: compiling (steps 2-3 "
                 "of 3)", "steady phase: running steps 2-3 of 3", "decoding"):  # fmt: skip
        assert line in err, line


@pytest.mark.slow
def test_comm_and_project_report_what_they_lower(tmp_path, capsys):
    assert main(["comm", "--model", "fmnist", "--resolution", "32", "--devices", "2",
                 "--strategy", "sync_patch", "--no-memory"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "lowering the warm-up phase's model call" in err
    assert "lowering the steady phase's model call" in err
    args = ["project", "--model", "fmnist", "--resolution", "32", "--devices", "2",
            "--strategy", "sync_patch", "--overlap", "step", "--workloads", str(tmp_path / "w")]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "not in the workload cache" in err and "lowering the text encoders" in err
    assert "overlap='step' has no effect: sync_patch sends nothing for a later step" in err


@pytest.mark.slow
def test_generate_in_processes_reports_each_rank_and_phase(tmp_path, capsys):
    args = ["generate", "--strategy", "distrifusion", "--devices", "2", "--processes", "2",
            "--steps", "4", "--warmup-steps", "0", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "launching 2 worker(s)" in err
    for rank in (0, 1):
        for phase in ("warm-up phase: compiling", "steady phase: running steps 2-4 of 4"):
            assert f"[rank {rank}] {phase}" in err
