"""A diffusers UNet2DConditionModel's config.json as the network's shape (`UNetConfig`), with
the keys that must hold one value checked (anything else is not implemented)."""

from __future__ import annotations

from dataclasses import dataclass, field

from patchpar.models.layers import as_list

DOWN_TYPES = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_TYPES = ("CrossAttnUpBlock2D", "UpBlock2D")

# config.json keys that must hold exactly these values (anything else is not implemented).
_REQUIRED = {
    "act_fn": "silu",
    "center_input_sample": False,
    "class_embed_type": None,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "dual_cross_attention": False,
    "encoder_hid_dim": None,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "only_cross_attention": False,
    "resnet_time_scale_shift": "default",
    "time_embedding_type": "positional",
    "time_cond_proj_dim": None,
    "reverse_transformer_layers_per_block": None,
    "attention_type": "default",
    "class_embeddings_concat": False,
    "cross_attention_norm": None,
    "mid_block_only_cross_attention": None,
    "num_class_embeds": None,
    "time_embedding_dim": None,
    "timestep_post_act": None,
    "addition_embed_type_num_heads": 64,
}


@dataclass(frozen=True)
class UNetConfig:
    """The parts of a diffusers UNet2DConditionModel config.json that shape the network."""

    in_channels: int = 4
    out_channels: int = 4
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    down_block_types: tuple[str, ...] = DOWN_TYPES[:1] * 3 + DOWN_TYPES[1:]
    up_block_types: tuple[str, ...] = UP_TYPES[1:] + UP_TYPES[:1] * 3
    layers_per_block: int = 2
    heads: tuple[int, ...] = (8, 8, 8, 8)  # diffusers' attention_head_dim/num_attention_heads
    transformer_layers_per_block: tuple[int, ...] = (1, 1, 1, 1)
    cross_attention_dim: int = 768
    use_linear_projection: bool = False
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    flip_sin_to_cos: bool = True
    freq_shift: float = 0.0
    downsample_padding: int = 1
    addition_embed_type: str | None = None  # None or "text_time" (SDXL)
    addition_time_embed_dim: int | None = None
    projection_class_embeddings_input_dim: int | None = None
    sample_size: int = 64
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_downsamples(self) -> int:
        return len(self.block_out_channels) - 1

    @classmethod
    def from_diffusers(cls, cfg: dict, where: str = "unet/config.json") -> UNetConfig:
        """Parse and validate a diffusers config dict; unsupported values raise ValueError."""
        required = ["block_out_channels", "down_block_types", "up_block_types"]
        if cfg.get("addition_embed_type") == "text_time":
            required += ["addition_time_embed_dim", "projection_class_embeddings_input_dim"]
        missing = [k for k in required if cfg.get(k) is None]
        if missing:
            raise ValueError(
                f"{where}: required key(s) {missing} missing (a diffusers UNet2DConditionModel "
                f"config has them; found keys: {sorted(cfg)[:12]}...)"
            )
        cin, cout = cfg.get("in_channels", 4), cfg.get("out_channels", 4)
        if cin != cout:
            raise ValueError(
                f"{where}: in_channels={cin} != out_channels={cout}: an inpainting or other "
                f"conditioned-input UNet is not supported (text-to-image UNets have in == out)"
            )
        for key, want in _REQUIRED.items():
            got = cfg.get(key, want)
            if got != want and not (key == "cross_attention_norm" and got in (None, "")):
                raise ValueError(f"{where}: {key}={got!r} is not supported (supported: {want!r})")
        # upcast_attention needs nothing: attention logits and softmax are always float32.
        n = len(cfg["block_out_channels"])
        down = tuple(cfg["down_block_types"])
        up = tuple(cfg["up_block_types"])
        for name, types, known in (
            ("down_block_types", down, DOWN_TYPES),
            ("up_block_types", up, UP_TYPES),
        ):
            bad = [t for t in types if t not in known]
            if bad or len(types) != n:
                raise ValueError(
                    f"{where}: {name}={list(types)} not supported: need {n} entries from {list(known)}"
                )
        if not isinstance(cfg.get("layers_per_block", 2), int):
            raise ValueError(
                f"{where}: layers_per_block={cfg['layers_per_block']!r}: only an int is supported"
            )
        if isinstance(cfg.get("cross_attention_dim"), list):
            raise ValueError(f"{where}: a per-block cross_attention_dim is not supported")
        add = cfg.get("addition_embed_type")
        if add not in (None, "text_time"):
            raise ValueError(
                f"{where}: addition_embed_type={add!r} not supported (None or 'text_time')"
            )
        # diffusers names heads `attention_head_dim` for historical reasons (see its UNet docstring).
        heads = cfg.get("num_attention_heads") or cfg.get("attention_head_dim", 8)
        return cls(
            in_channels=cfg.get("in_channels", 4),
            out_channels=cfg.get("out_channels", 4),
            block_out_channels=tuple(cfg["block_out_channels"]),
            down_block_types=down,
            up_block_types=up,
            layers_per_block=cfg.get("layers_per_block", 2),
            heads=tuple(as_list(heads, n, f"{where}: attention_head_dim")),
            transformer_layers_per_block=tuple(
                as_list(
                    cfg.get("transformer_layers_per_block", 1),
                    n,
                    f"{where}: transformer_layers_per_block",
                )
            ),
            cross_attention_dim=cfg.get("cross_attention_dim", 1280),
            use_linear_projection=bool(cfg.get("use_linear_projection", False)),
            norm_num_groups=cfg.get("norm_num_groups", 32),
            norm_eps=cfg.get("norm_eps", 1e-5),
            flip_sin_to_cos=cfg.get("flip_sin_to_cos", True),
            freq_shift=cfg.get("freq_shift", 0),
            downsample_padding=cfg.get("downsample_padding", 1),
            addition_embed_type=add,
            addition_time_embed_dim=cfg.get("addition_time_embed_dim"),
            projection_class_embeddings_input_dim=cfg.get("projection_class_embeddings_input_dim"),
            sample_size=cfg.get("sample_size", 64),
            extra=dict(cfg),
        )
