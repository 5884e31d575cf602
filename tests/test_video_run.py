"""`patchpar run` on a video model (`fmnist-video-random`: a pixel-space Wan, 8 grey frames of
32x32): the frames and layout of the run, its videos measured frame by frame beside single's,
the video measures (each frame against the one before, the tracked motion, the temporal error)
and a video model's bad inputs."""

import numpy as np
import pytest

from patchpar.lab.config import RunConfig
from patchpar.lab.configio import with_overrides
from patchpar.lab.runner import run

PROMPTS = ["a sneaker moving left", "a bag zooming in"]


def video_config(tmp_path, **over) -> RunConfig:
    base = with_overrides(RunConfig(), {
        "experiment": "video",
        "model.name": "fmnist-video-random",
        "sampler": {"name": "unipc", "steps": 3, "guidance_scale": 5.0},
        "prompts": {"prompts": PROMPTS, "seeds": [0]},
        "measure": {"warmup_runs": 0, "repeats": 1,
                    "quality": ["psnr", "ssim", "prev_frame", "motion_accuracy",
                                "temporal_error"]},
        "results": str(tmp_path),
    })  # fmt: skip
    return with_overrides(base, over)


def test_an_exact_video_run_is_single_measured_frame_by_frame(tmp_path):
    """sync_patch over a 2 x 2 grid of frames x rows on 4 devices makes single's videos: every
    frame single's to rounding, the same frame-to-frame PSNR and the same motion and temporal
    measures. Its latent is single's within float rounding (6e-6 here, the keys folded in
    another order: 5.7e-6 with the kernel before), so an 8-bit frame is identical or a pixel
    one level off where a value lies on a rounding edge (78 dB: one of 1024 pixels)."""
    base = run(video_config(tmp_path), raise_errors=True)
    grid = run(video_config(tmp_path, **{"strategy.name": "sync_patch", "mesh.devices": 4,
                                         "mesh.layout": "2x2"}), raise_errors=True)  # fmt: skip
    b, g = base["metrics"], grid["metrics"]
    assert grid["status"] == "ok" and g["layout"] is not None
    assert g["latent_max_abs_diff"] <= 1e-4
    assert len(g["psnr_by_frame"]) == 8 and all(v is None or v >= 70 for v in g["psnr_by_frame"])
    assert g["quality_frames"] == 16 and g["frames"] == 8 and g["quality_samples"] == 2
    for k in ("prev_frame_psnr", "prev_frame_ssim", "motion_accuracy", "temporal_error"):
        assert g[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    assert set(g["motion_accuracy_by_motion"]) == {"moving left", "zooming in"}
    assert all(p.endswith(".gif") for p in grid["images"])


@pytest.mark.slow  # a third compile: the stale run
def test_a_stale_video_run_differs_frame_by_frame(tmp_path):
    """DistriFusion over frames on 2 devices differs from single's videos, frame by frame."""
    stale = run(video_config(tmp_path, **{"strategy": {"name": "distrifusion",
                                                       "warmup_steps": 0},
                                          "mesh.devices": 2}), raise_errors=True)  # fmt: skip
    s = stale["metrics"]
    assert not s["identical"] and len(s["psnr_by_frame"]) == 8
    assert all(np.isfinite(v) for v in s["psnr_by_frame"])
    assert min(s["psnr_by_frame"]) <= s["psnr"] <= max(s["psnr_by_frame"])


@pytest.mark.parametrize(
    "over, message",
    [
        ({"model.name": "tiny", "sampler.name": "ddim", "prompts.prompts": ["a red bag"],
          "measure.quality": ["psnr", "prev_frame"]},
         r"measure.quality has \['prev_frame'\]: measures of a video model's frames; tiny makes "
         r"images"),
        ({"prompts.prompts": ["a sneaker dancing"], "measure.quality": ["motion_accuracy"]},
         r"prompt 'a sneaker dancing': no motion of fmnist-video's vocabulary ends it; nearest"),
        ({"sampler.frames": 0}, r"sampler.frames=0: must be a positive integer"),
        ({"model.name": "tiny", "sampler.name": "ddim", "sampler.frames": 5,
          "measure.quality": ["psnr"]}, r"frames=5: tiny makes images, not video"),
        ({"strategy.name": "sync_patch", "mesh.devices": 4, "mesh.layout": "3x1"},
         r"layout='3x1': 3 x 1 = 3 blocks for 4 patch devices; .*grids that fit: "
         r"\['1x4', '2x2', '4x1'\]"),
    ],
)  # fmt: skip
def test_bad_video_runs_are_one_line_errors(tmp_path, over, message):
    with pytest.raises(ValueError, match=message) as err:
        run(video_config(tmp_path, **over), raise_errors=True)
    assert "\n" not in str(err.value).strip()


def test_a_clip_length_not_trained_is_a_warning(tmp_path):
    """A folder whose transformer names the clip lengths it was trained on (`trained_frames`,
    as fmnist-video's) warns, naming them, when asked for another length; its own is silent."""
    import json
    import shutil
    import warnings

    from patchpar.models.presets import preset_folder
    from patchpar.pipelines import load_pipeline

    folder = tmp_path / "model"
    shutil.copytree(preset_folder("fmnist-video-random"), folder)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "trained_frames": [8]}))
    pipe = load_pipeline(folder)
    with pytest.warns(UserWarning, match=r"frames=9: this model was trained on clips of \[8\] "):
        assert pipe(PROMPTS[:1], steps=1, frames=9).frames.shape[1] == 9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(PROMPTS[:1], steps=1)
