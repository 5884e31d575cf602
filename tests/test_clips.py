"""The fmnist-video clips (`lab/clips.py`) and the motion measures on them (`measure/motion.py`):
clips are reproducible from (split, index, seed), every motion appears equally often, the
tracker reads every ground-truth clip's motion, the temporal error is small on a clip and large
once its frames are shuffled, and prompts outside the vocabulary name the nearest words."""

import numpy as np
import pytest

from patchpar.lab.clips import FRAMES, MOTIONS, SIZE, caption, clips, parse_prompt
from patchpar.measure.motion import classify_motion, motion_accuracy, temporal_error, track


@pytest.fixture(scope="module")
def some():
    return clips("test", 120, seed=0)


def test_clips_are_reproducible_and_balanced(some):
    x, labels, motions, caps = some
    assert x.shape == (120, FRAMES, SIZE, SIZE) and x.dtype == np.uint8
    again, *_ = clips("test", 10, seed=0, start=5)
    assert (again == x[5:15]).all()  # a clip is drawn from (split, index, seed) alone
    other, *_ = clips("test", 10, seed=1, start=5)
    assert (other != x[5:15]).any()
    assert np.bincount(motions, minlength=len(MOTIONS)).tolist() == [20] * len(MOTIONS)
    assert caps[0] == caption(int(labels[0]), 0) and caps[0].endswith("moving left")
    assert caption(9, 4) == "an ankle boot zooming in"
    assert all(c.max() > 128 for c in x[:, 0])  # the item is on every first frame


def test_the_tracker_reads_every_clip(some):
    x, _, motions, _ = some
    assert motion_accuracy(x, motions) == 1.0
    centroids, areas = track(x[4])  # zooming in: the area grows
    assert areas[-1] > 2 * areas[0]
    steady, *_ = clips("test", 2, seed=0, profile="constant")
    c, _ = track(steady[1])  # moving right at a constant pace: 2 pixels a frame
    assert np.allclose(np.diff(c[:, 1]), 2, atol=0.5)
    assert classify_motion(x[2][::-1]) == 3  # up, played backwards, is down


def test_an_accelerating_clip_shows_the_arrow_of_time(some):
    """The accelerating pace (the default) starts and ends where the constant one does, its
    steps grow frame by frame (played backwards they shrink: no clip of the set), and the
    tracker reads it."""
    x, *_ = clips("test", 12, seed=0, profile="constant")
    fast, _, motions, _ = clips("test", 12, seed=0, profile="accelerating")
    assert (fast == some[0][:12]).all()
    for i in (0, 1):  # moving left, moving right: same first and last frame, another pace
        assert (fast[i][[0, -1]] == x[i][[0, -1]]).all() and (fast[i] != x[i]).any()
        steps = np.abs(np.diff(track(fast[i])[0][:, 1]))
        assert (np.diff(steps) >= -0.5).all() and steps[-1] > steps[0] + 2, steps
    areas = track(fast[4])[1]  # zooming in: the growth speeds up
    assert areas[-1] - areas[-2] > areas[1] - areas[0]
    assert motion_accuracy(fast, motions) == 1.0
    with pytest.raises(ValueError, match="motion profile 'jerky'; known"):
        clips("test", 2, profile="jerky")


def test_temporal_error_is_what_the_motion_does_not_explain(some):
    x, labels, _, _ = some
    err = [temporal_error(c) for c in x[:24]]
    assert max(err[m] for m in range(4)) < 1e-3  # a translation carries its first frame exactly
    # every other frame another clip's item (of another class), on the same track
    mixed = []
    for i in range(24):
        j = next(k for k in range(24, 120) if labels[k] != labels[i] and k % 6 == i % 6)
        c = x[i].copy()
        c[1::2] = x[j][1::2]
        mixed.append(temporal_error(c))
    assert np.mean(err) < 0.25 * np.mean(mixed), (np.mean(err), np.mean(mixed))


def test_the_classifier_reads_the_item_of_every_frame(some):
    """`item_crops` cuts each frame's item out at the classifier's 28 x 28: on ground-truth clips
    (items 12-24 pixels, not Fashion-MNIST's 28) the fmnist classifier names the class of most
    frames, the ceiling a generated clip's class accuracy is measured under."""
    from patchpar.measure.classifier import predict
    from patchpar.measure.motion import item_crops
    from patchpar.models.presets import SHIPPED

    x, labels, _, _ = some
    crops = np.concatenate([item_crops(c) for c in x])
    assert crops.shape == (len(x) * FRAMES, 28, 28) and crops.dtype == np.uint8
    got = predict(SHIPPED["fmnist"] / "classifier", crops).reshape(len(x), FRAMES)
    assert (got == labels[:, None]).mean() >= 0.75


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("a sneaker moving sideways", r"no motion .* nearest: \['moving"),
        ("a snaker moving left", r"class 'snaker' is not one of .* nearest: \['sneaker'"),
    ],
)
def test_prompts_outside_the_vocabulary_are_named(prompt, message):
    assert parse_prompt("A Sneaker  moving left") == (7, 0)
    assert parse_prompt("an ankle boot zooming out") == (9, 5)
    with pytest.raises(ValueError, match=message):
        parse_prompt(prompt)


@pytest.mark.slow  # compiles a Wan training step: trains, exports and resumes in miniature
def test_video_train_script_exports_resumes_and_refuses_another_recipe(
    tmp_path, capsys, monkeypatch
):
    """experiments/train_fmnist_video.py in miniature (12 clips, two steps): a pixel-space
    WanPipeline folder the pipeline loads and runs, the same video on 2 frame patches as on one
    device, a resume, and a changed recipe refused."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    from patchpar.parallel.engine import Plan
    from patchpar.parallel.strategies import make_strategy
    from patchpar.pipelines import load_pipeline

    experiments = Path(__file__).resolve().parent.parent / "experiments"
    monkeypatch.syspath_prepend(str(experiments))
    spec = importlib.util.spec_from_file_location(
        "train_fmnist_video", experiments / "train_fmnist_video.py"
    )
    train = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_fmnist_video", train)
    spec.loader.exec_module(train)
    cfg = train.TrainConfig(max_steps=2, batch=4, clips=12, work=tmp_path / "work",
                            out=tmp_path / "out", plots=tmp_path / "plots")  # fmt: skip
    train.main(cfg)
    info = json.loads((cfg.out / "training.json").read_text())
    assert info["trained_steps"] == 2 and info["recipe"]["clips"] == 12
    assert (cfg.out / "classifier" / "model.safetensors").is_file()
    pipe = load_pipeline(cfg.out)
    assert pipe.vae is None and pipe.family == "wan"
    one = pipe(["a sneaker moving left"], steps=2, seed=0)
    two = pipe(["a sneaker moving left"], steps=2, seed=0,
               plan=Plan(make_strategy("sync_patch"), 2))  # fmt: skip
    assert one.frames.shape == (1, FRAMES, SIZE, SIZE, 3)
    np.testing.assert_allclose(two.latents, one.latents, atol=1e-4, rtol=0)
    train.main(train.TrainConfig(**{**vars(cfg), "max_steps": 3}))
    assert "resumed at step 2" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"different recipe \(differs in \['lr'\]\)"):
        train.main(train.TrainConfig(**{**vars(cfg), "lr": 2e-3}))
    import probe_fmnist_video as probe  # the caption-swap probe reads the recipe's checkpoint

    probe.main(["--checkpoint", str(cfg.work / "checkpoint.msgpack"), "--clips", "6",
                "--out", str(tmp_path / "probe")])  # fmt: skip
    record = json.loads((tmp_path / "probe" / "records.jsonl").read_text())
    assert record["trained_steps"] == 3 and set(record["loss"]) == {
        "right", "motion_reversed", "motion_turned", "other_class"}  # fmt: skip
    assert all(len(v) == len(probe.LEVELS) and np.isfinite(v).all()
               for v in record["loss"].values())  # fmt: skip
    assert set(record["equivariance_gap"]) == {"played_backwards", "mirrored"}


def test_the_probe_swaps_each_motion_for_its_reverse_and_its_quarter_turn():
    """probe_fmnist_video's swaps: left <-> right, up <-> down, in <-> out reversed; a quarter
    turn takes a direction to the other axis (a zoom to the other zoom)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "experiments" / "probe_fmnist_video.py"
    spec = importlib.util.spec_from_file_location("probe_fmnist_video", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    words = [m.split()[1] for m in MOTIONS]
    opposite = {"left": "right", "right": "left", "up": "down", "down": "up", "in": "out",
                "out": "in"}  # fmt: skip
    assert [words[r] for r in probe.REVERSED] == [opposite[w] for w in words]
    axis = {"left": "h", "right": "h", "up": "v", "down": "v", "in": "z", "out": "z"}
    for m, t in enumerate(probe.TURNED):
        assert t != m and (axis[words[t]] != axis[words[m]] or axis[words[m]] == "z")


def test_clip_frames_are_a_ground_truth(some):
    """`fmnist-clips` (fid_gt's reference for fmnist-video) is the frames of the test clips of
    seed 0, clip after clip, as RGB; an unknown split is an error naming the ones there are."""
    from patchpar.lab.datasets import check_ground_truth, ground_truth

    check_ground_truth("fmnist-clips")
    frames = ground_truth("fmnist-clips", 20)
    assert frames.shape == (20, SIZE, SIZE, 3) and frames.dtype == np.uint8
    np.testing.assert_array_equal(frames[:FRAMES, ..., 0], some[0][0])
    np.testing.assert_array_equal(frames[FRAMES : 2 * FRAMES, ..., 1], some[0][1])
    with pytest.raises(
        ValueError, match=r"unknown split 'val'; use .*fmnist-clips\[:test\|:train\]"
    ):
        check_ground_truth("fmnist-clips:val")


def test_a_classifier_saved_from_non_contiguous_arrays_reads_back(tmp_path):
    """`classifier.save` writes each array in its logical order: a TPU hands arrays back to the
    host in its own layout (here a transposed view stands in), and safetensors writes memory as
    it lies."""
    import jax
    import jax.numpy as jnp

    from patchpar.measure import classifier as clf

    module = clf.FashionCNN()
    params = module.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))["params"]
    kernel = np.asarray(params["Dense_0"]["kernel"])
    params["Dense_0"]["kernel"] = np.asfortranarray(kernel)  # same values, other memory order
    assert not params["Dense_0"]["kernel"].flags.c_contiguous
    clf.save(tmp_path, params, module.width, 0.0)
    _, loaded = clf.load.__wrapped__(str(tmp_path))
    np.testing.assert_array_equal(loaded["Dense_0"]["kernel"], kernel)


def test_an_rgb_clip_measures_as_its_grey_one(some):
    """A pipeline's frames are RGB uint8 (grey repeated): every measure reads them as the grey
    clip (the scale comes from the dtype given, before the channels are averaged)."""
    from patchpar.measure.motion import item_crops

    for clip in some[0][:12]:
        rgb = np.repeat(clip[..., None], 3, axis=-1)
        np.testing.assert_allclose(track(rgb)[0], track(clip)[0], atol=1e-4)
        np.testing.assert_array_equal(track(rgb)[1], track(clip)[1])
        assert classify_motion(rgb) == classify_motion(clip)
        assert temporal_error(rgb) == pytest.approx(temporal_error(clip), abs=1e-5)
        np.testing.assert_array_equal(item_crops(rgb), item_crops(clip))


def test_the_shipped_fmnist_video_makes_the_prompted_item_and_motion():
    """The committed fmnist-video (experiments/train_fmnist_video.py), on its tuned sampler,
    makes for every class two of the six motions: clips whose tracked motion is the prompt's
    and whose frames its classifier reads as the prompt's class (published on 240 held-out
    clips: paper_repro.md, "The fmnist-video model")."""
    from patchpar.lab.defaults import default_guidance
    from patchpar.lab.video_quality import item_crops_of
    from patchpar.measure.classifier import predict
    from patchpar.models.presets import SHIPPED
    from patchpar.pipelines import load_pipeline

    pairs = [(c, m) for c in range(10) for m in (c % 6, (c + 3) % 6)]
    pipe = load_pipeline("fmnist-video")
    out = pipe([caption(c, m) for c, m in pairs], steps=20,
               guidance_scale=default_guidance("fmnist-video"), seed=0)  # fmt: skip
    labels, motions = np.array(pairs).T
    assert motion_accuracy(out.frames, motions) >= 0.9
    got = predict(SHIPPED["fmnist-video"] / "classifier", item_crops_of(out.frames))
    assert (got.reshape(len(pairs), -1) == labels[:, None]).mean() >= 0.6
