"""PixArt's parts against their PyTorch references in fp32: the Flax T5 encoder against
transformers' T5EncoderModel, the T5 tokenizer against transformers', and the Flax PixArt
transformer against diffusers' PixArtTransformer2DModel (max abs diff <= 1e-4 of the output's
scale), on tiny random configs."""

import json
import warnings

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("sentencepiece")

from torch_refs import close  # noqa: E402

from patchpar.models.api import load_pixart, load_t5_encoder  # noqa: E402
from patchpar.models.loading import CheckpointError  # noqa: E402
from patchpar.models.pixart import PixArtConfig, sincos_table  # noqa: E402
from patchpar.models.t5 import T5Config, relative_position_buckets  # noqa: E402
from patchpar.models.tokenizer import T5Tokenizer, write_t5_tokenizer  # noqa: E402

# ---------------------------------------------------------------------------- T5 encoder


def tiny_t5(ff: str, seed: int = 0):
    from transformers import T5Config as HFConfig
    from transformers import T5EncoderModel

    torch.manual_seed(seed)
    cfg = HFConfig(
        vocab_size=99,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=3,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=12,
        feed_forward_proj=ff,
        dropout_rate=0.0,
    )
    return T5EncoderModel(cfg).eval()


@pytest.mark.parametrize("ff", [pytest.param("relu", marks=pytest.mark.slow), "gated-gelu"])
def test_t5_encoder_matches_transformers(ff, tmp_path):
    """Sequences of 40 tokens (beyond the bias's max_distance of 12: its buckets saturate),
    each image with its own padding."""
    ref = tiny_t5(ff)
    ref.save_pretrained(tmp_path)
    fn, params = load_t5_encoder(tmp_path)
    assert fn.config.is_gated_act == (ff == "gated-gelu")
    rng = np.random.RandomState(0)
    ids = rng.randint(3, 99, (3, 40)).astype(np.int32)
    mask = np.ones((3, 40), np.int32)
    mask[1, 25:] = 0  # padded
    mask[2, 7:] = 0
    ids[mask == 0] = 0
    ours = jax.jit(fn)(params, ids, mask)["last_hidden_state"]
    with torch.no_grad():
        theirs = ref(
            input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)
        ).last_hidden_state.numpy()
    close(ours, theirs)
    # without a mask every token is attended to
    with torch.no_grad():
        whole = ref(input_ids=torch.tensor(ids, dtype=torch.long)).last_hidden_state.numpy()
    close(jax.jit(fn)(params, ids)["last_hidden_state"], whole)


def test_relative_buckets_match_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    for buckets, distance, n in ((32, 128, 300), (8, 12, 40), (16, 20, 7)):
        rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        theirs = T5Attention._relative_position_bucket(
            rel, bidirectional=True, num_buckets=buckets, max_distance=distance
        ).numpy()
        np.testing.assert_array_equal(relative_position_buckets(n, n, buckets, distance), theirs)


def test_t5_config_errors_name_the_value():
    with pytest.raises(ValueError, match="feed_forward_proj='gated-gelu-x'"):
        T5Config.from_transformers({"feed_forward_proj": "gated-gelu-x"}, "c.json")
    with pytest.raises(ValueError, match="activation 'tanh' not supported"):
        T5Config.from_transformers({"feed_forward_proj": "tanh"}, "c.json")
    with pytest.raises(ValueError, match="not a T5 encoder"):
        T5Config.from_transformers({"architectures": ["BertModel"]}, "c.json")


# ---------------------------------------------------------------------------- T5 tokenizer

PROMPTS = [
    "a photo of a red trouser",
    "An ankle boot on a white background",
    "a black sneaker, seen from the side",
    "two bags and a dress",
] * 8


def test_t5_tokenizer_matches_transformers_and_warns_on_truncation(tmp_path):
    from transformers import AutoTokenizer

    folder = write_t5_tokenizer(tmp_path / "tok", PROMPTS, vocab_size=60)
    ours = T5Tokenizer(folder)
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    prompts = ["A Photo of a red trouser ", "two bags", "a black sneaker, seen from the side"]
    ids, mask = ours(prompts, max_length=16)
    theirs = hf(
        [p.lower().strip() for p in prompts],
        padding="max_length",
        max_length=16,
        truncation=True,
        return_attention_mask=True,
    )
    np.testing.assert_array_equal(ids, np.asarray(theirs["input_ids"]))
    np.testing.assert_array_equal(mask, np.asarray(theirs["attention_mask"]))
    assert ids.dtype == np.int32 and (ids[mask == 1][-1] == 1)  # ends with </s>
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        short, short_mask = ours(["a black sneaker, seen from the side"], max_length=4)
    assert short[0, -1] == ours.eos_id and short_mask.sum() == 4
    assert any("truncated" in str(w.message) for w in caught)
    with pytest.raises(CheckpointError, match="spiece.model"):
        T5Tokenizer(tmp_path)


# ---------------------------------------------------------------------------- PixArt transformer

ALPHA = dict(  # PixArt-α-like: micro-conditions (resolution, aspect ratio), interpolation 1
    num_attention_heads=3,
    attention_head_dim=8,
    in_channels=4,
    out_channels=8,
    num_layers=2,
    cross_attention_dim=24,
    caption_channels=20,
    sample_size=8,
    patch_size=2,
    use_additional_conditions=True,
)
SIGMA = dict(  # PixArt-Σ-like: no micro-conditions, interpolation scale 2
    ALPHA, use_additional_conditions=False, interpolation_scale=2, num_attention_heads=2,
    attention_head_dim=16, cross_attention_dim=32,
)  # fmt: skip


def make_pixart(config: dict, seed: int = 0):
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(seed)
    model = PixArtTransformer2DModel(**config).eval()
    with torch.no_grad():  # diffusers' init leaves biases at zero: give every one a value
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def nchw(x):
    return torch.tensor(np.asarray(x).transpose(0, 3, 1, 2))


@pytest.mark.parametrize(
    "config, hw",
    [
        pytest.param(ALPHA, (8, 8), marks=pytest.mark.slow),
        (ALPHA, (8, 12)),
        (SIGMA, (8, 8)),
        pytest.param(SIGMA, (12, 8), marks=pytest.mark.slow),
    ],
)
def test_pixart_matches_diffusers(config, hw, tmp_path):
    """The native size and a non-square one (positions computed at that size), with a text
    mask that differs per image."""
    ref = make_pixart(config)
    ref.save_pretrained(tmp_path)
    fn, params = load_pixart(tmp_path)
    assert fn.config.use_additional_conditions == config["use_additional_conditions"]
    rng = np.random.RandomState(0)
    x = rng.randn(2, *hw, 4).astype(np.float32)
    t = np.array([3.0, 871.0], np.float32)
    ctx = rng.randn(2, 6, 20).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], np.int32)
    added = {}
    if config["use_additional_conditions"]:
        added = {
            "resolution": np.array([[64.0, 64.0], [64.0, 96.0]], np.float32),
            "aspect_ratio": np.array([[1.0], [0.75]], np.float32),
        }
    ours = jax.jit(fn)(params, x, t, ctx, mask, added or None)
    with torch.no_grad():
        theirs = ref(
            nchw(x),
            encoder_hidden_states=torch.tensor(ctx),
            timestep=torch.tensor(t),
            added_cond_kwargs={k: torch.tensor(v) for k, v in added.items()} or None,
            encoder_attention_mask=torch.tensor(mask),
        ).sample.numpy()
    assert ours.shape == (2, *hw, 8)
    close(ours, theirs.transpose(0, 2, 3, 1))


def test_positions_match_diffusers_at_any_size():
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    cfg = PixArtConfig.from_diffusers(SIGMA)
    base = cfg.sample_size // cfg.patch_size
    for rows, cols in ((4, 4), (4, 6), (9, 5), (64, 64)):
        theirs = get_2d_sincos_pos_embed(
            cfg.inner_dim, (rows, cols), base_size=base, interpolation_scale=2.0, output_type="pt"
        ).float()
        np.testing.assert_array_equal(sincos_table(cfg, rows, cols), theirs.numpy())


def test_older_transformer2d_folders_load_and_other_dits_are_named(tmp_path):
    ref = make_pixart(SIGMA)
    ref.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "_class_name": "Transformer2DModel"}))
    fn, _ = load_pixart(tmp_path)
    assert fn.config.num_layers == 2
    for name, family in (
        ("SanaTransformer2DModel", "Sana"),
        ("QwenImageTransformer2DModel", "Qwen"),
    ):
        path.write_text(json.dumps({**cfg, "_class_name": name}))
        with pytest.raises(ValueError, match=f"{family}.*not supported yet"):
            load_pixart(tmp_path)
    with pytest.raises(ValueError, match="micro-conditions"):
        fn({}, np.zeros((1, 8, 8, 4)), 1.0, np.zeros((1, 6, 20)), None, {"resolution": 1})


def test_load_denoiser_finds_the_family_and_the_engine_checks_its_row_multiple(tmp_path):
    from torch_refs import make_unet

    from patchpar.models import PixArtFn, UNetFn, load_denoiser
    from patchpar.parallel.engine import Plan
    from patchpar.parallel.strategies import make_strategy

    make_pixart(SIGMA).save_pretrained(tmp_path / "pipe" / "transformer")
    make_unet("sd1").save_pretrained(tmp_path / "unet")
    dit, _ = load_denoiser(tmp_path / "pipe")
    unet, _ = load_denoiser(tmp_path / "unet")
    assert isinstance(dit, PixArtFn) and dit.row_multiple == 2
    assert isinstance(unet, UNetFn) and unet.row_multiple == 2**unet.config.num_downsamples
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"_class_name": "PriorTransformer"}')
    with pytest.raises(CheckpointError, match="PriorTransformer.*not a denoiser"):
        load_denoiser(tmp_path / "other")
    plan = Plan(make_strategy("sync_patch"), 2)
    plan.validate(dit, (8, 12), 4, 1.0)  # 4 token rows per device
    plan.validate(dit, (10, 8), 4, 1.0)  # 5 token rows: 3 and 2 (uneven patches)
    with pytest.raises(ValueError, match=r"rows=2 are 1 unit\(s\) of 2 \(patch size 2\)"):
        plan.validate(dit, (2, 8), 4, 1.0)
    with pytest.raises(ValueError, match="feed-forward width 128 is not divisible by 3"):
        dit.check_split(3)
