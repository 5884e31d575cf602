"""Checks before work: every problem of a command's options found at once, from the options and
the model's config.json alone (no weight read), each reported as its own line.

    problems = Problems.collect()
    with problems.check():
        check_seed(seed)            # a ValueError here is noted, and the next check runs
    with problems.check():
        plan = build_plan(...)
    problems.raise_any()            # Problems (a ValueError): one line per problem

The CLI prints a `Problems` as one `patchpar: error:` line per problem (exit 2). The checks
more than one command makes are here too: the plan against the model's config.json
(`check_plan_on_model` for a run, `check_lowering` for abstract weights), scanned blocks
(`check_scan`), an FSDP with nothing to shard (`fsdp_unused`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


class Problems(ValueError):
    """Every problem found in one command's options, one line each (a ValueError, so that
    whatever catches bad input catches it; its text is the lines joined)."""

    def __init__(self, lines: list[str]):
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))

    @classmethod
    def collect(cls) -> Collector:
        return Collector()


class Collector:
    """Runs checks one after another, noting each one's ValueError (or Problems) instead of
    stopping at the first."""

    def __init__(self):
        self.lines: list[str] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        """A block of checks: its first ValueError is noted, and the block ends there. Another
        error (a config.json that cannot be read) is raised, unless problems were found
        already: then it is one more line, so that none of them is lost."""
        try:
            yield
        except Problems as e:
            self.lines += e.lines
        except ValueError as e:
            self.lines.append(str(e))
        except Exception as e:  # noqa: BLE001 - said with the problems found, or raised
            if not self.lines:
                raise
            self.lines.append(f"{type(e).__name__}: {e}")

    def raise_any(self) -> None:
        if self.lines:
            raise Problems(self.lines)


def check_plan_on_model(
    model: str | Path,
    plan,
    height: int | None,
    width: int | None,
    steps: int,
    guidance_scale: float,
    true_cfg_scale: float,
    build_mesh: bool,
    scan_blocks: bool = False,
    frames: int | None = None,
    layout: str = "frames",
) -> tuple[int, int]:
    """Every check of `plan` against `model` that its config.json answers (no weight is read):
    the image size against the VAE factor and the denoiser's row multiple, the strategy, mesh
    and cache against the denoiser; the image size (h, w) it runs at. A video model's `frames`
    (default its own) and `layout` (`check_video`). `build_mesh=False`: the devices are
    elsewhere (launched processes). The pipeline checks all of it again once loaded; this is
    what lets a bad option fail before minutes of loading."""
    from patchpar.models.presets import abstract_denoiser, latent_factor
    from patchpar.pipelines.checks import check_image_size

    unet = abstract_denoiser(model).with_scan(scan_blocks)
    factor = latent_factor(model)
    h, w = default_size(unet, factor, height, width)
    problems = Problems.collect()
    with problems.check():
        latent = check_image_size(unet, factor, h, w)
        unet, latent = check_video(model, unet, latent, frames, layout, plan)
        # the loop's guidance: CFG where a call has two halves; a guidance-distilled model
        # (FLUX.1) guides in the loop only with true CFG
        loop = guidance_scale if unet.guidance_halves == 2 else max(true_cfg_scale, 1.0)
        plan.validate(unet, latent, steps, loop, build_mesh=build_mesh)
    problems.raise_any()
    return h, w


def default_size(unet, factor: int, height: int | None, width: int | None) -> tuple[int, int]:
    """The image (or frame) size a run makes where height or width is unset: a video model's
    own (`default_size`), else its square sample size (width: the height)."""
    if hasattr(unet, "default_size"):
        dh, dw = unet.default_size
        return (dh if height is None else height), (dw if width is None else width)
    h = unet.config.sample_size * factor if height is None else height
    return h, (h if width is None else width)


def check_video(model, unet, latent: tuple[int, int], frames, layout: str, plan=None):
    """(the denoiser on its video, the tall latent (rows, w)) for a video model of `frames`
    frames (None: its own) cut by `layout` into `plan`'s patches; an image model's latent as
    it is. ValueError naming the value: a frame count its VAE does not take (the nearest that
    fit), a layout that does not cut the video into the patches, frames or a layout other
    than `frames` given for an image model."""
    from patchpar.models.presets import model_family, temporal_factor

    if not model_family(model).video:
        if frames is not None:
            raise ValueError(
                f"frames={frames}: {model} makes images, not video (frames is for a video "
                f"model: wan2.1-1.3b, tiny-wan, ...)"
            )
        if layout != "frames":
            raise ValueError(
                f"layout={layout!r}: {model} makes images; the layout cuts a video model's "
                f"frames (leave it at 'frames')"
            )
        return unet, latent
    from patchpar.models.video import on_video

    frames = unet.default_frames if frames is None else frames
    patches = plan.patch if plan is not None and plan.splits_row_patches else None
    return on_video(unet, frames, layout, temporal_factor(model), latent, patches)


def images_only(model: str | Path, command: str) -> None:
    """ValueError where `command` is given a video model (it works on images)."""
    from patchpar.models.presets import model_family

    if model_family(model).video:
        raise ValueError(
            f"model {str(model)!r} makes video: `patchpar {command}` works on images so far; "
            f"`patchpar generate` makes its videos and `patchpar comm` lowers it (--frames)"
        )


def check_video_metrics(model: str | Path, quality) -> None:
    """ValueError where `quality` names a video model's measure for a model of images."""
    from patchpar.lab.measure_config import VIDEO_METRICS
    from patchpar.models.presets import model_family

    video = [q for q in quality if q in VIDEO_METRICS]
    if video and not model_family(model).video:
        raise ValueError(
            f"measure.quality has {video}: measures of a video model's frames; {model} makes "
            f"images (drop them, or run a video model: tiny-wan, a Wan folder, ...)"
        )


def check_lowering(model: str | Path, latent, plan, batch: int, steps: int,
                   scan_blocks: bool = False, frames: int | None = None,
                   layout: str = "frames"):  # fmt: skip
    """A plan that `comm` or `project` lowers with abstract weights, checked against the
    model's config.json first (no weight read): the plan (mesh, devices, strategy, `steps`,
    cache) against the denoiser on a `latent` (a side, square, or (h, w); a video model's
    frames of it, `check_video`), with the guidance the lowering uses (`measure.cost.
    measure`'s). Returns (the denoiser, on its video, the latent (rows, w) it lowers)."""
    from patchpar.models.presets import abstract_denoiser

    unet = abstract_denoiser(model).with_scan(scan_blocks)
    hw = latent if isinstance(latent, tuple) else (latent, latent)
    unet, hw = check_video(model, unet, hw, frames, layout, plan)
    guidance = 5.0 if unet.guidance_halves == 2 else 1.0
    plan.validate(unet, hw, steps, guidance, batch)
    return unet, hw


def check_scan(scan_blocks: bool, quant: str, strategy: str) -> None:
    """Scanned blocks run whole, on float weights: ValueError for a quantized model or a
    strategy that runs the blocks apart (each its own stage or device)."""
    if not scan_blocks:
        return
    if quant != "none":
        raise ValueError(
            f"scan_blocks with quant={quant!r}: a quantized model runs its blocks unrolled; "
            f"turn one of them off"
        )
    if strategy in ("pipefusion", "asyncdiff"):
        raise ValueError(
            f"scan_blocks with strategy {strategy!r}: it runs the blocks apart (stages of "
            f"layers); turn scan_blocks off"
        )


def fsdp_unused(devices: int) -> str:
    return (
        f"fsdp has no effect on {devices} device(s) here: no two devices run the same weights "
        f"(one device, or tensor parallelism over all of them), so there is nothing to shard"
    )


def clip_ok(model: str, m) -> bool:
    """clip_score has a CLIP to use (`m`: a run's MeasureConfig): the model's default, a
    shipped name, a local-dir folder, or a named open_clip model with its checkpoint (whether
    the files load is checked before generating: patchpar.lab.evaluate.check_quality_inputs)."""
    from patchpar.lab.defaults import DEFAULT_CLIP
    from patchpar.models.presets import CLIP_MODELS

    if m.clip_model is None:
        return model in DEFAULT_CLIP
    return (
        m.clip_model in CLIP_MODELS
        or m.clip_model.startswith("local-dir:")
        or Path(m.clip_model).is_dir()
        or bool(m.clip_checkpoint)
    )
