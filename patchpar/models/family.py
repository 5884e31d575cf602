"""Model families as plug-ins (docs/design.md §1a).

A family is one package under `patchpar/models/` (`unet`, `pixart`, ...) whose `FAMILY`, a
`Family`, answers everything the rest of patchpar asks about a model of it: which diffusers
folders and presets are its own, how to build its denoiser from a config and load it, how its
prompts become a `Conditioning` (its text encoders), its text encoders' programs (for their
FLOPs), and how to write a random-weight folder of a preset. The denoiser it builds satisfies
the `Denoiser` protocol, which is all the engine, the pipeline, the measurements and the lab
use. The registry (`families`, `family_of`) is the one place that decides which family a
folder or preset is; an unknown one is an error that lists the known.

Adding a family is one package (its model, config, presets and `FAMILY`) and its name in
`PACKAGES`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import jax

from patchpar.models.loading import CheckpointError, read_config

if TYPE_CHECKING:
    from patchpar.models.attention import AttentionSpec
    from patchpar.models.sites import SiteOps
    from patchpar.sampling.guidance import Conditioning

# The family packages under patchpar/models/, in the order folders are matched.
PACKAGES = ("unet", "pixart", "flux", "sd3", "wan")

# What people point patchpar at that no family runs: a pipeline's or a denoiser's
# `_class_name` (a substring of it) -> what it is.
UNSUPPORTED = {
    "QwenImage": "Qwen-Image (an MMDiT transformer, not supported yet)",
    "WanImageToVideo": "Wan image-to-video (not supported yet; patchpar runs Wan text-to-video)",
    "WanVideoToVideo": "Wan video-to-video (not supported yet; patchpar runs Wan text-to-video)",
    "WanVACE": "Wan VACE (not supported yet; patchpar runs Wan text-to-video)",
    "HunyuanVideo": "HunyuanVideo (a video DiT, not supported yet)",
    "Sana": "Sana (a linear-attention DiT, not supported yet)",
    "HunyuanDiT": "HunyuanDiT (not supported yet)",
    "DiTPipeline": "DiT (class-conditional, not text-to-image)",
    "DiTTransformer2DModel": "DiT (class-conditional)",
    "Inpaint": "inpainting (a UNet with extra input channels)",
    "Img2Img": "image-to-image",
    "ControlNet": "ControlNet",
}


@runtime_checkable
class Denoiser(Protocol):
    """What the engine runs (docs/design.md §1): a small frozen object that keeps its Flax
    module, called as `fn(params, sample (B, H, W, C), timesteps, encoder_hidden_states,
    **extras)` -> the network's output (B, H, W, C_out)."""

    family: str  # its family's name
    logical: tuple  # its parameters' logical axes (`parallel.rules`)
    splits_columns: bool  # whether its patches may cut columns as well as rows
    text_tokens: int  # the text tokens abstract lowering assumes (`engine.abstract_inputs`)
    guidance_halves: int  # halves of a guided model call: 2 with classifier-free guidance, 1
    text_stream: bool  # whether every device computes a text stream (an MMDiT's joint blocks)
    caches: tuple[str, ...]  # the step caches it has (`sampling.cache`): its forward in parts

    @property
    def module(self) -> Any: ...

    @property
    def config(self) -> Any: ...

    @property
    def quant_mode(self) -> str | None:
        """The mode its module was quantized with (`patchpar.quant`); None: not quantized."""
        ...

    @property
    def row_multiple(self) -> int:
        """Latent rows of one patch must be a multiple of this."""
        ...

    @property
    def row_multiple_reason(self) -> str: ...

    @property
    def stack(self) -> Any:
        """The forward as input part, identical blocks and output part (`Stack`), for a
        strategy that splits the layers (PipeFusion); None without one (a UNet)."""
        ...

    no_stack: str  # where `stack` is None: why (for the error a layer-split strategy gives)

    def prediction(self, out: jax.Array) -> jax.Array:
        """The sampler's model output from the network's."""
        ...

    def check_split(self, model: int) -> None:
        """ValueError when tensor parallelism over `model` devices does not split it."""
        ...

    def __call__(self, params, sample, timesteps, encoder_hidden_states, **extras): ...

    def with_ops(self, ops: SiteOps) -> Denoiser: ...

    def as_patch(self, rows: tuple[int, ...]) -> Denoiser:
        """The denoiser each row patch (of `rows` latent rows each) runs as a whole input of
        its own (naive patch): an image model itself; a video model on its slab's video."""
        ...

    def with_attention(self, spec: AttentionSpec) -> Denoiser: ...

    def with_scan(self, on: bool = True) -> Denoiser:
        """Its runs of identical blocks as scanned loops (`patchpar.models.scan`), or
        unrolled."""
        ...

    @property
    def scanned(self) -> bool:
        """Whether its runs of identical blocks run as scanned loops."""
        ...

    def prepare(self, params):
        """The parameters as its module takes them, from the checkpoint's layout (a scanned
        stack's blocks stacked, `patchpar.models.scan`); done once before a run's programs."""
        ...

    def example_inputs(self, batch: int = 1, height=None, width=None, seq: int = 77):
        """((sample, timesteps, encoder_hidden_states), {extras}) as abstract arrays."""
        ...

    def abstract_params(self): ...

    def init(self, seed: int = 0): ...


class TextConditioner(Protocol):
    """A family's prompts -> `Conditioning` (the text encoders and tokenizers of a folder)."""

    encoders: list  # [(fn, params)]
    tokenizers: list

    def loop_scale(self, guidance_scale: float) -> float:
        """The classifier-free guidance scale of the denoising loop for a pipeline's
        `guidance_scale` (itself for CFG families; 1 where the scale is a model input, FLUX)."""
        ...

    def __call__(
        self, denoiser: Denoiser, prompts: list[str], negative: list[str], guidance_scale: float,
        height: int, width: int, empty_negative: bool,
    ) -> Conditioning:  # fmt: skip
        """The conditioning stacked over guidance: (negative, positive) where the loop guides
        (`loop_scale` > 1), else the positive alone. `empty_negative`: no negative prompt was
        given (SDXL then zeroes the negative embeddings)."""
        ...


class Family:
    """One model family. Subclasses fill the class attributes and the methods that raise."""

    name: ClassVar[str]
    denoiser_folder: ClassVar[str]  # the denoiser's subfolder of a pipeline folder
    denoiser_classes: ClassVar[tuple[str, ...]]  # its config.json `_class_name`s
    pipeline_classes: ClassVar[tuple[str, ...]]  # model_index.json `_class_name`s it runs
    presets: ClassVar[dict[str, dict[str, dict]]]  # preset name -> {component: config}
    full_size: ClassVar[tuple[str, ...]] = ()  # presets with published (full) shapes
    weighted: ClassVar[tuple[str, ...]] = ()  # presets written with random weights on first use
    default_guidance: ClassVar[float] = 7.5  # its pipelines' default guidance scale
    default_sampler: ClassVar[str] = "ddim"  # the sampler a run takes unless told
    # a flow-matching pipeline's sigmas before the shift (`SchedulerConfig.flow_sigmas`)
    flow_sigmas: ClassVar[str] = "linspace"
    video: ClassVar[bool] = False  # its pipelines make video (`pipelines.text2video`)

    # ---------------------------------------------------------------- the denoiser

    def denoiser(self, config: dict, where: str, dtype, attention: AttentionSpec) -> Denoiser:
        """The denoiser of a config.json (validated; ValueError naming `where`)."""
        raise NotImplementedError

    def load_denoiser(self, path: Path, dtype, attention: AttentionSpec):
        """(fn, params) of the denoiser folder `path` (a component folder)."""
        from patchpar.models.loading import read_state_dict, state_dict_to_params

        fn = self.denoiser(read_config(path), f"{path}/config.json", dtype, attention)
        state = read_state_dict(path)
        return fn, state_dict_to_params(state, fn.abstract_params(), str(path), dtype=dtype)

    def is_large(self, config: dict) -> bool:
        """Whether a denoiser config is of a full-size model (bfloat16 by default)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- the VAE

    def vae_factor(self, config: dict) -> int:
        """Image pixels per latent pixel of a vae/config.json."""
        from patchpar.models.vae import VAEConfig

        return VAEConfig.from_diffusers(config).downsample_factor

    def vae_temporal(self, config: dict) -> int:
        """Video frames per latent frame (after the first) of a vae/config.json; 1: images."""
        del config
        return 1

    def load_vae(self, path: Path, dtype, attention: AttentionSpec):
        """(fn, params) of the vae/ folder `path`."""
        from patchpar.models.components import load_vae

        return load_vae(path, dtype, attention)

    def abstract_vae(self, config: dict, dtype):
        """The VAE of a vae/config.json for lowering without weights (the `xla` attention
        kernel, the reference): its decode's FLOPs and collectives (`measure.workload`)."""
        from patchpar.models.api import VAEFn
        from patchpar.models.attention import XLA
        from patchpar.models.vae import AutoencoderKL, VAEConfig

        return VAEFn(AutoencoderKL(VAEConfig.from_diffusers(config, "vae"), dtype, attn=XLA))

    # ---------------------------------------------------------------- the text

    def check_index(self, index: dict) -> None:
        """Check a pipeline's model_index.json settings before any weight is read (ValueError
        naming the value); none to check by default."""

    def second_expert(self, index: dict) -> tuple[str, float] | None:
        """(the subfolder of a second expert, its boundary ratio) where a pipeline's
        model_index.json names one that runs (Wan 2.2: `transformer_2`, `boundary_ratio`;
        `sampling.experts`); None: one denoiser (the default)."""
        del index
        return None

    def load_text(self, folder: Path, index: dict, dtype) -> TextConditioner:
        """The text encoders and tokenizers of a pipeline folder."""
        raise NotImplementedError

    def text_programs(self, component: Callable[[str], dict | None], batch: int, dtype):
        """[(Flax module, abstract input ids)] of the text encoders, for their FLOPs:
        `component(sub)` is a component's config (None if absent), batch = prompts (both
        guidance halves counted by the caller)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- presets

    def write_random_folder(self, folder: Path, preset: dict[str, dict], seed: int) -> None:
        """A diffusers-format pipeline folder of `preset` with deterministic random weights."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<family {self.name}>"


T5_TOKENS = 512  # the most T5 tokens FluxPipeline and StableDiffusion3Pipeline take


def max_sequence_length(index: dict, default: int, pipeline: str) -> int:
    """The T5 tokens a pipeline reads (`max_sequence_length` in its model_index.json, else
    `default`), checked against its pipeline's limit before any encoder is loaded: ValueError
    naming the value."""
    tokens = index.get("max_sequence_length", default)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= T5_TOKENS:
        raise ValueError(
            f"max_sequence_length={tokens!r} in model_index.json: {pipeline} reads 1 to "
            f"{T5_TOKENS} T5 tokens (default {default})"
        )
    return tokens


@cache
def families() -> dict[str, Family]:
    """{name: family} of every package in `PACKAGES`."""
    out = {}
    for package in PACKAGES:
        fam = importlib.import_module(f"patchpar.models.{package}").FAMILY
        out[fam.name] = fam
    return out


def supported() -> str:
    """The families and what they run, for error messages."""
    return "; ".join(
        f"{f.name}: {', '.join(f.pipeline_classes + f.denoiser_classes)}"
        for f in families().values()
    )


def named(name: str) -> Family:
    try:
        return families()[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {list(families())}") from None


def of_preset(name: str) -> Family | None:
    """The family whose presets hold `name` (None: not a preset of any)."""
    return next((f for f in families().values() if name in f.presets), None)


def unsupported(class_name: str | None) -> str | None:
    """What an unsupported pipeline or denoiser class is (None: not one people use)."""
    if class_name is None:
        return None
    return next((v for k, v in UNSUPPORTED.items() if k in class_name), None)


def of_class(class_name: str) -> Family | None:
    return next(
        (
            f
            for f in families().values()
            if class_name in f.pipeline_classes or class_name in f.denoiser_classes
        ),
        None,
    )


def of_folder(folder: str | Path) -> Family:
    """The family of a diffusers folder: a pipeline folder (model_index.json's `_class_name`,
    else the denoiser subfolder it holds) or a denoiser component folder (config.json's
    `_class_name`). CheckpointError naming what it is and the supported families."""
    folder = Path(folder)
    if not folder.exists():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} does not exist")
    index = folder / "model_index.json"
    if index.is_file():
        try:
            name = json.loads(index.read_text()).get("_class_name")
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{str(index)!r} is not valid JSON: {e}") from None
        if name is not None:
            return _known(name, str(folder))
    for sub in dict.fromkeys(f.denoiser_folder for f in families().values()):
        if (folder / sub / "config.json").is_file():  # a pipeline folder without model_index
            name = read_config(folder / sub).get("_class_name")
            if name is None:  # an old config: the first family keeping its denoiser there
                return next(f for f in families().values() if f.denoiser_folder == sub)
            return _known(name, str(folder / sub))
    return _known(read_config(folder).get("_class_name"), str(folder))


def _known(class_name: str | None, where: str) -> Family:
    fam = of_class(class_name) if class_name else None
    if fam is not None:
        return fam
    what = unsupported(class_name)
    runs = supported()
    if what is not None:
        raise CheckpointError(
            f"{where!r}: unsupported: {class_name} is {what}; patchpar runs {runs}"
        )
    raise CheckpointError(
        f"{where!r}: _class_name={class_name!r} is not a denoiser or pipeline patchpar runs "
        f"(supported: {runs})"
    )
