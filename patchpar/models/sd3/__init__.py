"""The SD3 family (Stable Diffusion 3 and 3.5): `SD3Transformer2DModel` in Flax (`model`), its
presets (`presets`), the denoiser `SD3Fn` and its layer `Stack`, the three-encoder conditioning
of `StableDiffusion3Pipeline`, and `FAMILY`, what the rest of patchpar asks of it
(`patchpar.models.family`)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from patchpar.models.attention import AUTO, AttentionSpec, resolve
from patchpar.models.components import abstract_init
from patchpar.models.family import T5_TOKENS, Family, max_sequence_length
from patchpar.models.loading import CheckpointError, read_config
from patchpar.models.sd3 import presets as _presets
from patchpar.models.sd3.model import (
    BLOCK,
    CLASS_NAMES,
    LOGICAL,
    JointBlock,
    SD3Config,
    SD3Transformer2DModel,
    position_table,
    sincos_grid,
)
from patchpar.models.wrapper import JointStack, TokenDenoiser

MAX_SEQUENCE_LENGTH = T5_TOKENS  # the most T5 tokens StableDiffusion3Pipeline takes
POS_EMBED_KEY = "pos_embed.pos_embed"  # the position table diffusers keeps in the checkpoint


@dataclass(frozen=True)
class SD3Fn(TokenDenoiser):
    """`sd3_apply(params, sample (B, H, W, C), timesteps (B,), encoder_hidden_states (B, S, Dt),
    pooled_projections=(B, Dp))` -> (B, H, W, C): the timesteps as every flow-matching denoiser
    of patchpar takes them (sigma in [0, 1]; the model embeds sigma x 1000, what diffusers' SD3
    pipeline passes its transformer), diffusers' names for the rest."""

    module: SD3Transformer2DModel
    family = "sd3"
    logical = LOGICAL  # its parameters' logical axes (`parallel.rules`)
    splits_columns = False  # its positions and tokens are cut by rows only
    text_tokens = 77 + 256  # CLIP's 77 and T5's 256 (the pipeline's default) join every block
    text_stream = True  # every device computes the text stream (`parallel.sites.text`)
    caches = ("fbcache", "taylorseer")  # the step caches it has (`patchpar.sampling.cache`)
    guidance_halves = 2  # classifier-free guidance

    no_stack = ""  # it has one (`stack`)

    @property
    def stack(self) -> Stack:
        """The forward's parts, for a strategy that splits the layers (PipeFusion, AsyncDiff).
        Not of a quantized module: the stack runs its blocks as plain joint blocks outside the
        module (the last block lifted to its run's kind), where Qwix does not reach."""
        mode = self.quant_mode
        if mode is not None:
            raise ValueError(
                f"quant={mode!r}: SD3's layer-splitting stack runs its blocks outside the "
                f"quantized module (the last block lifted to a plain one), where Qwix does not "
                f"reach; use a one-call strategy (sync_patch, distrifusion, pcpp, ulysses) with a "
                f"quantized SD3, or PipeFusion/AsyncDiff unquantized"
            )
        return Stack(self.module)

    def prediction(self, out: jax.Array) -> jax.Array:
        """The sampler's model output from the network's: all of it (the flow's velocity)."""
        return out

    def __call__(self, params, sample, timesteps, encoder_hidden_states, pooled_projections=None):
        if pooled_projections is None:
            raise ValueError(
                "an SD3 transformer needs pooled_projections (the CLIP pooled outputs)"
            )
        return self.module.apply(
            {"params": self.prepare(params)},
            sample,
            timesteps,
            encoder_hidden_states,
            pooled_projections,
        )

    def example_inputs(
        self, batch: int = 1, height: int | None = None, width: int | None = None, seq: int = 333
    ):
        """Abstract inputs of the right shapes (latent size = sample_size unless given):
        (sample, timesteps, encoder_hidden_states) and the pooled text as a keyword input."""
        cfg, dt = self.config, self.module.dtype
        h, w = height or cfg.sample_size, width or cfg.sample_size
        sds = jax.ShapeDtypeStruct
        args = (
            sds((batch, h, w, cfg.in_channels), dt),
            sds((batch,), jnp.float32),
            sds((batch, seq, cfg.joint_attention_dim), dt),
        )
        return args, {"pooled_projections": sds((batch, cfg.pooled_projection_dim), dt)}

    def abstract_params(self):
        """The parameters' shapes, in the unrolled layout (as checkpoints hold them)."""
        p = self.config.patch_size
        args, added = self.example_inputs(1, p, p, seq=4)
        return abstract_init(self.module.clone(scan=False), *args, **added)


def _lifted(block: dict, dim: int) -> dict:
    """A context_pre_only block's parameters as a plain joint block's that gives the same
    image tokens: its text norm's (scale, shift) become the first two of six modulation parts
    (the others zero), and the text output layers it lacks are zeros (its text tokens, which
    nothing reads, are then its input's)."""
    z = jnp.zeros
    norm = block["norm1_context"]["linear"]
    kernel, bias = norm["kernel"], norm["bias"]
    k6 = z((kernel.shape[0], 6 * dim), kernel.dtype).at[:, :dim].set(kernel[:, dim:])
    k6 = k6.at[:, dim : 2 * dim].set(kernel[:, :dim])
    b6 = z((6 * dim,), bias.dtype).at[:dim].set(bias[dim:]).at[dim : 2 * dim].set(bias[:dim])
    dt = kernel.dtype
    ff = {"net_0": {"proj": {"kernel": z((dim, 4 * dim), dt), "bias": z((4 * dim,), dt)}},
          "net_2": {"kernel": z((4 * dim, dim), dt), "bias": z((dim,), dt)}}  # fmt: skip
    attn = {**block["attn"], "to_add_out": {"kernel": z((dim, dim), dt), "bias": z((dim,), dt)}}
    return {**block, "norm1_context": {"linear": {"kernel": k6, "bias": b6}}, "attn": attn,
            "ff_context": ff}  # fmt: skip


def _runs(config: SD3Config) -> list[tuple[bool, list[int]]]:
    """The blocks as runs of one kind: (dual attention, the block indices)."""
    runs: list[tuple[bool, list[int]]] = []
    for i in range(config.num_layers):
        dual = i in config.dual_attention_layers
        if runs and runs[-1][0] == dual:
            runs[-1][1].append(i)
        else:
            runs.append((dual, [i]))
    return runs


@dataclass(frozen=True)
class Stack(JointStack):
    """SD3's transformer as a stack (`wrapper.JointStack`). The segments are the runs of
    identical joint blocks (SD3 and SD3.5-large: one; SD3.5-medium: its 13 dual-attention
    blocks, then the others), the context_pre_only last block lifted to one of its run's kind
    that gives the same image tokens (`_lifted`); a stage keeps the image K/V of each block's
    joint attention, and of a dual block's second one."""

    module: SD3Transformer2DModel

    @property
    def segment_layers(self) -> tuple[int, ...]:
        return tuple(len(ids) for _, ids in _runs(self.module.config))

    @property
    def segment_kv_names(self) -> tuple[tuple[str, ...], ...]:
        return tuple(("attn", "attn2") if d else ("attn",) for d, _ in _runs(self.module.config))

    def segment_blocks(self, params) -> tuple[list, ...]:
        last = self.module.config.num_layers - 1

        def block(i):
            b = params[BLOCK.format(i)]
            if i != last:
                return b
            if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(b)):
                return jax.eval_shape(lambda x: _lifted(x, self.width), b)  # abstract
            return _lifted(b, self.width)

        return tuple([block(i) for i in ids] for _, ids in _runs(self.module.config))

    def block_names(self) -> set[str]:
        return {BLOCK.format(i) for i in range(self.num_layers)}

    def time(self, outer, timesteps, extras: dict):
        """(B, D): the timestep (sigma) and the pooled text embedded."""
        run = lambda m, t, p: m.time(t, p, t.shape[0])  # noqa: E731
        return self._apply(self.module.ops, outer, run, timesteps, extras["pooled_projections"])

    def embed(self, outer, ops, sample, variables=None, ctx=None):
        """(B, h, W, C) latent rows -> (image tokens, the text tokens `ctx`)."""
        nested = {k: {"pos_embed": v} for k, v in (variables or {}).items()}
        return self._apply(ops, outer, "embed", sample, variables=nested), ctx

    def block(self, outer, ops, block_params, h, ctx, temb, row, variables=None, mutable=(),
              segment: int = 0):  # fmt: skip
        """A joint block of `segment`'s kind with `block_params` on the (image, text) tokens
        -> (tokens, the `mutable` collections)."""
        del outer, ctx  # the text tokens travel in h
        m = self.module
        dual = _runs(m.config)[segment][0]
        block = JointBlock(m.config, False, dual, m.dtype, ops, m.attn)
        out = block.apply({"params": block_params, **(variables or {})}, *h, temb, row,
                          mutable=list(mutable) or False)  # fmt: skip
        return out if mutable else (out, {})


@dataclass
class SD3Conditioning:
    """StableDiffusion3Pipeline's text: CLIP-L's and CLIP-G's penultimate hidden states side by
    side (77 tokens), zero-padded to T5's width, then T5's last hidden states (`tokens`, no
    mask); the pooled output is both CLIPs' projected pooled outputs side by side. Without T5
    (text_encoder_3 left out, as diffusers allows) its tokens are zeros. Classifier-free
    guidance: [negative, positive], the negative prompt ("" if none) encoded like the prompt."""

    encoders: list  # [CLIP-L, CLIP-G, T5 or None]
    tokenizers: list
    tokens: int = 256  # T5 tokens (the pipeline's max_sequence_length)
    joint_dim: int = 4096  # the transformer's joint_attention_dim (T5's width)

    def __post_init__(self):
        if not 1 <= self.tokens <= MAX_SEQUENCE_LENGTH:
            raise ValueError(
                f"max_sequence_length={self.tokens}: SD3 reads 1 to {MAX_SEQUENCE_LENGTH} T5 "
                f"tokens (StableDiffusion3Pipeline's limit; default 256)"
            )

    def loop_scale(self, guidance_scale: float) -> float:
        return guidance_scale  # classifier-free guidance

    def __call__(self, denoiser, prompts, negative, guidance_scale, height, width, empty_negative):
        from patchpar.sampling.guidance import Conditioning

        del denoiser, height, width, empty_negative
        cfg = guidance_scale > 1.0
        texts = list(negative) + list(prompts) if cfg else list(prompts)
        g, b = 2 if cfg else 1, len(prompts)
        ctx, pooled = self.embed(texts)
        return Conditioning(
            ctx.reshape((g, b) + ctx.shape[1:]), {"pooled_projections": pooled.reshape(g, b, -1)}
        )

    def embed(self, texts: list[str]) -> tuple[jax.Array, jax.Array]:
        """(B, 77 + tokens, joint_dim) text states and (B, pooled) pooled outputs."""
        from patchpar.models.components import encode_text

        states, pooled = [], []
        for (fn, params), tok in zip(self.encoders[:2], self.tokenizers[:2], strict=True):
            out = encode_text(fn, params, jnp.asarray(tok(texts)))
            states.append(out["hidden_states"][-2])
            pooled.append(out.get("text_embeds", out["pooler_output"]))
        clip = jnp.concatenate(states, axis=-1)
        clip = jnp.pad(clip, ((0, 0), (0, 0), (0, self.joint_dim - clip.shape[-1])))
        if self.encoders[2] is None:
            t5 = jnp.zeros((len(texts), self.tokens, self.joint_dim), clip.dtype)
        else:
            (fn, params), tok = self.encoders[2], self.tokenizers[2]
            ids, _ = tok(texts, self.tokens)
            t5 = encode_text(fn, params, jnp.asarray(ids))["last_hidden_state"]
        return jnp.concatenate([clip, t5.astype(clip.dtype)], axis=1), jnp.concatenate(pooled, -1)


class SD3Family(Family):
    name = "sd3"
    denoiser_folder = "transformer"
    denoiser_classes = CLASS_NAMES
    pipeline_classes = ("StableDiffusion3Pipeline",)
    presets = _presets.PRESETS
    full_size = _presets.FULL_SIZE
    weighted = _presets.WEIGHTED
    default_guidance = 7.0  # diffusers' StableDiffusion3Pipeline
    default_sampler = "flow_euler"  # flow matching: FlowMatchEulerDiscreteScheduler
    flow_sigmas = "scheduler"  # the pipeline passes no sigmas: the scheduler's own range

    def denoiser(self, config, where, dtype=jnp.float32, attention=None) -> SD3Fn:
        attn = attention if attention is not None else AttentionSpec()
        return SD3Fn(SD3Transformer2DModel(SD3Config.from_diffusers(config, where), dtype,
                                           attn=attn))  # fmt: skip

    def load_denoiser(self, path: Path, dtype, attention: AttentionSpec):
        """(fn, params); the position table the checkpoint keeps is the one the model computes
        (checked against it), so it is not a parameter."""
        from patchpar.models.loading import read_state_dict, state_dict_to_params

        fn = self.denoiser(read_config(path), f"{path}/config.json", dtype, attention)
        state = read_state_dict(path)
        table = state.pop(POS_EMBED_KEY, None)
        if table is not None:
            cfg = fn.config
            want = sincos_grid(cfg.inner_dim, cfg.pos_embed_max_size,
                               cfg.sample_size // cfg.patch_size)  # fmt: skip
            if table.size != want.size or not np.allclose(
                np.asarray(table, np.float32).reshape(want.shape), want, atol=1e-3
            ):
                raise CheckpointError(
                    f"{path}: {POS_EMBED_KEY} is not the 2-D sin-cos table of its config "
                    f"(pos_embed_max_size={cfg.pos_embed_max_size}, sample_size="
                    f"{cfg.sample_size}, patch_size={cfg.patch_size}): a learned or resized "
                    f"position table is not supported"
                )
        return fn, state_dict_to_params(state, fn.abstract_params(), str(path), dtype=dtype)

    def is_large(self, config: dict) -> bool:
        return config.get("num_attention_heads", 24) * config.get("attention_head_dim", 64) >= 1024

    def check_index(self, index: dict) -> None:
        max_sequence_length(index, 256, "StableDiffusion3Pipeline")

    def load_text(self, folder: Path, index: dict, dtype) -> SD3Conditioning:
        from patchpar.models.components import load_t5_encoder, load_text_encoder
        from patchpar.models.tokenizer import T5Tokenizer, load_tokenizer

        tokens = max_sequence_length(index, 256, "StableDiffusion3Pipeline")  # before loading
        for enc, tok, what in (("text_encoder", "tokenizer", "CLIP-L"),
                               ("text_encoder_2", "tokenizer_2", "CLIP-G")):  # fmt: skip
            for sub in (enc, tok):
                if not (folder / sub).is_dir():
                    raise CheckpointError(
                        f"{str(folder)!r}: an SD3 pipeline needs {sub}/ ({what}); it is missing. "
                        f"Both CLIP encoders are required; only T5 (text_encoder_3/) may be left "
                        f"out, as diffusers allows"
                    )
        encoders = [load_text_encoder(folder / "text_encoder", dtype),
                    load_text_encoder(folder / "text_encoder_2", dtype, "text_encoder_2")]  # fmt: skip
        tokenizers = [load_tokenizer(folder / "tokenizer"), load_tokenizer(folder / "tokenizer_2")]
        if (folder / "text_encoder_3").is_dir():
            if not (folder / "tokenizer_3").is_dir():
                raise CheckpointError(
                    f"{str(folder)!r}: text_encoder_3/ (T5) is there but tokenizer_3/ is missing"
                )
            encoders.append(load_t5_encoder(folder / "text_encoder_3", dtype, "text_encoder_3"))
            tokenizers.append(T5Tokenizer(folder / "tokenizer_3", lower=False))
        else:
            warnings.warn(
                f"{folder}: no text_encoder_3/ (T5): the pipeline runs without it, its tokens "
                "zeros (as diffusers' StableDiffusion3Pipeline with text_encoder_3=None); "
                "prompt adherence is weaker",
                stacklevel=3,
            )
            encoders.append(None)
            tokenizers.append(None)
        cfg = read_config(folder / "transformer")
        return SD3Conditioning(encoders, tokenizers, tokens,
                               int(cfg.get("joint_attention_dim", 4096)))  # fmt: skip

    def text_programs(self, component, batch: int, dtype):
        from patchpar.models.clip import CLIPTextConfig, CLIPTextModel
        from patchpar.models.t5 import T5Config, T5EncoderModel

        out = []
        for sub in ("text_encoder", "text_encoder_2"):
            if (cfg := component(sub)) is not None:
                module = CLIPTextModel(CLIPTextConfig.from_transformers(cfg, sub), dtype)
                out.append((module, jax.ShapeDtypeStruct((batch, 77), jnp.int32)))
        if (cfg := component("text_encoder_3")) is not None:
            module = T5EncoderModel(T5Config.from_transformers(cfg, "text_encoder_3"), dtype)
            tokens = (component("pipeline") or {}).get("max_sequence_length", 256)
            out.append((module, jax.ShapeDtypeStruct((batch, tokens), jnp.int32)))
        return out

    def write_random_folder(self, folder: Path, preset: dict, seed: int) -> None:
        """An SD3 pipeline folder: transformer/ (with diffusers' position table), vae/, CLIP-L
        and CLIP-G text_encoder(_2)/ and tokenizer(_2)/, a T5 text_encoder_3/ and its
        sentencepiece tokenizer_3/ (trained here on a few captions), scheduler/,
        model_index.json."""
        from safetensors.numpy import save_file

        from patchpar.models.clip import CLIPTextConfig, CLIPTextModel
        from patchpar.models.components import T5EncoderFn, TextEncoderFn, VAEFn
        from patchpar.models.configs import TOKENIZER_TEXT
        from patchpar.models.loading import params_to_state_dict, write_component, write_scheduler
        from patchpar.models.t5 import T5Config, T5EncoderModel
        from patchpar.models.tokenizer import write_clip_tokenizer, write_t5_tokenizer
        from patchpar.models.vae import AutoencoderKL, VAEConfig

        folder = Path(folder)
        fn = self.denoiser(preset["transformer"], "transformer")
        params = fn.init(seed)
        write_component(folder / "transformer", preset["transformer"], params)
        cfg = fn.config
        state = params_to_state_dict(params)  # and the position table diffusers loads
        grid = sincos_grid(cfg.inner_dim, cfg.pos_embed_max_size, cfg.sample_size // cfg.patch_size)
        state[POS_EMBED_KEY] = grid.reshape(1, -1, cfg.inner_dim)
        save_file(state, str(folder / "transformer" / "diffusion_pytorch_model.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
        vae = VAEFn(AutoencoderKL(VAEConfig.from_diffusers(preset["vae"]), jnp.float32))
        write_component(folder / "vae", preset["vae"], vae.init(seed + 1))
        index = {"_class_name": preset["pipeline"]["_class_name"],
                 "transformer": ["diffusers", "SD3Transformer2DModel"],
                 "vae": ["diffusers", "AutoencoderKL"]}  # fmt: skip
        for k, sub in enumerate(("text_encoder", "text_encoder_2")):
            te = TextEncoderFn(CLIPTextModel(CLIPTextConfig.from_transformers(preset[sub])))
            write_component(folder / sub, preset[sub], te.init(seed + 2 + k))
            tok = sub.replace("text_encoder", "tokenizer")
            write_clip_tokenizer(folder / tok)
            index[sub] = ["transformers", "CLIPTextModelWithProjection"]
            index[tok] = ["transformers", "CLIPTokenizer"]
        t5_cfg = preset["text_encoder_3"]
        t5 = T5EncoderFn(T5EncoderModel(T5Config.from_transformers(t5_cfg)))
        write_component(folder / "text_encoder_3", t5_cfg, t5.init(seed + 4))
        write_t5_tokenizer(folder / "tokenizer_3", TOKENIZER_TEXT, vocab_size=t5_cfg["vocab_size"])
        index["text_encoder_3"] = ["transformers", "T5EncoderModel"]
        index["tokenizer_3"] = ["transformers", "T5TokenizerFast"]
        write_scheduler(folder, preset["scheduler"])
        index["scheduler"] = ["diffusers", preset["scheduler"]["_class_name"]]
        if "max_sequence_length" in preset["pipeline"]:
            index["max_sequence_length"] = preset["pipeline"]["max_sequence_length"]
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def load_sd3(path, dtype=jnp.float32, attention: AttentionSpec = AUTO):
    """SD3 transformer from a diffusers folder (`.../transformer` or a pipeline folder holding
    `transformer/`)."""
    from patchpar.models.components import component

    return FAMILY.load_denoiser(component(path, "transformer"), dtype, resolve(attention, dtype))


FAMILY = SD3Family()

__all__ = [
    "FAMILY", "LOGICAL", "MAX_SEQUENCE_LENGTH", "SD3Conditioning", "SD3Config", "SD3Fn",
    "SD3Transformer2DModel", "Stack", "load_sd3", "position_table",
]  # fmt: skip
