"""CLIP tokenizer: loaded from a diffusers folder's `tokenizer/` (vocab.json + merges.txt), and
written from the BPE vocabulary that ships inside open-clip-torch, so a model folder made here
has a real tokenizer offline."""

from __future__ import annotations

import gzip
import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np

from patchpar.models.loading import CheckpointError

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte -> printable unicode table (the BPE works on these characters), in CLIP's
    order: printable bytes first, then the others mapped above U+0100. The order sets the ids."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    out = {b: chr(b) for b in keep}
    for extra, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + extra)
    return out


def open_clip_bpe_path() -> Path:
    """The gzipped BPE merges file inside the installed open-clip-torch (found without importing
    it, so torch is not needed)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the CLIP BPE vocabulary comes from the package open-clip-torch, which is not installed "
            "(pip install open-clip-torch)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "bpe_simple_vocab_16e6.txt.gz"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing from the installed open-clip-torch")
    return path


def write_clip_tokenizer(folder: str | Path, max_length: int = 77, pad_token: str = EOS) -> Path:
    """Write vocab.json, merges.txt and tokenizer_config.json (OpenAI CLIP's 49408-token BPE)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(open_clip_bpe_path(), "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]  # 48894 merges after the version header, as CLIP uses
    chars = list(_bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars] + ["".join(m.split()) for m in merges] + [BOS, EOS]
    (folder / "vocab.json").write_text(
        json.dumps({tok: i for i, tok in enumerate(vocab)}, ensure_ascii=False)
    )
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8"
    )
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": max_length,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": EOS,
        "pad_token": pad_token,
        "do_lower_case": True,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


class Tokenizer:
    """Prompts -> (B, max_length) int32 token ids, padded and truncated as the SD pipelines do.
    Reads vocab.json + merges.txt, or tokenizer.json (what transformers 5 saves)."""

    def __init__(self, folder: str | Path):
        from transformers import CLIPTokenizer

        folder = Path(folder)
        has_bpe = (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
        if not has_bpe and not (folder / "tokenizer.json").is_file():
            present = (
                sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "folder missing"
            )
            raise CheckpointError(
                f"no CLIP tokenizer in {str(folder)!r}: need vocab.json and merges.txt, or tokenizer.json "
                f"(found: {present})"
            )
        self.hf = CLIPTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.max_length = int(self.hf.model_max_length)
        if self.max_length > 10_000:  # transformers' "no limit" sentinel
            self.max_length = 77

    def __call__(self, prompts: list[str]) -> np.ndarray:  # (B, max_length) int32
        enc = self.hf(
            list(prompts), padding="max_length", max_length=self.max_length, truncation=True
        )
        self._warn_truncated(prompts)
        return np.asarray(enc["input_ids"], np.int32)

    def _warn_truncated(self, prompts: list[str]) -> None:
        """Say which words the text encoder never sees (diffusers warns the same way)."""
        full = self.hf(list(prompts), truncation=False)["input_ids"]
        for prompt, ids in zip(prompts, full, strict=True):
            if len(ids) > self.max_length:
                dropped = self.hf.decode(ids[self.max_length - 1 : -1])
                warnings.warn(
                    f"prompt {prompt[:40]!r}... has {len(ids)} tokens; the text encoder takes "
                    f"{self.max_length}, so this part was truncated: {dropped!r}",
                    stacklevel=3,
                )


def load_tokenizer(path: str | Path, subfolder: str = "tokenizer") -> Tokenizer:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"tokenizer folder {str(path)!r} does not exist")
    return Tokenizer(path / subfolder if (path / subfolder).is_dir() else path)


# ---------------------------------------------------------------------------- T5 (sentencepiece)

T5_PAD, T5_EOS, T5_UNK = 0, 1, 2  # T5's sentencepiece ids: <pad>, </s>, <unk>


def write_t5_tokenizer(
    folder: str | Path, texts: list[str], vocab_size: int = 256, model_type: str = "unigram"
) -> Path:
    """Train a small sentencepiece model on `texts` (offline, a second at most) and write it as
    a T5 tokenizer folder: `spiece.model` with T5's special ids (<pad> 0, </s> 1, <unk> 2, no
    <s>) and `tokenizer_config.json`. For tests, the random-weight presets and fmnist-dit.
    `model_type`: unigram (T5's; on a few short texts it stays near characters) or bpe (merges
    up to whole words, characters for the rest)."""
    import io

    import sentencepiece as spm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=T5_PAD,
        eos_id=T5_EOS,
        unk_id=T5_UNK,
        bos_id=-1,
        hard_vocab_limit=False,  # a small corpus may not fill the vocabulary
        minloglevel=2,
    )
    (folder / "spiece.model").write_bytes(model.getvalue())
    config = {
        "tokenizer_class": "T5Tokenizer",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "extra_ids": 0,
        "model_max_length": 512,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


class T5Tokenizer:
    """Prompts -> (ids, mask), each (B, max_length) int32, as PixArt's pipelines tokenize: the
    prompt lower-cased and stripped (diffusers' `clean_caption=False` preprocessing), its
    sentencepiece pieces then </s>, truncated to max_length - 1 pieces + </s>, padded with
    <pad>; mask 1 on real tokens. Reads the folder's `spiece.model` (the sentencepiece model,
    as T5's own folders hold it), else its `tokenizer.json` (the same unigram model as
    transformers' fast tokenizer saves it)."""

    def __init__(self, folder: str | Path, lower: bool = True):
        folder = Path(folder)
        self.lower = lower  # PixArt lower-cases the prompt; FLUX passes it as it is
        path = folder / "spiece.model"
        if path.is_file():
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor(model_file=str(path))
            self._encode, self._decode = sp.encode, sp.decode
            self.pad_id, self.eos_id = max(sp.pad_id(), 0), sp.eos_id()
        elif (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as Fast

            path = folder / "tokenizer.json"
            fast = Fast.from_file(str(path))
            self._encode = lambda text: fast.encode(text, add_special_tokens=False).ids
            self._decode = fast.decode
            self.pad_id = fast.token_to_id("<pad>") or 0
            self.eos_id = -1 if fast.token_to_id("</s>") is None else fast.token_to_id("</s>")
        else:
            present = (
                sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "folder missing"
            )
            raise CheckpointError(
                f"no T5 tokenizer in {str(folder)!r}: spiece.model (the sentencepiece model) is "
                f"missing, and so is tokenizer.json (found: {present})"
            )
        if self.eos_id < 0:
            raise CheckpointError(f"{str(path)!r} has no </s> piece: not a T5 tokenizer")

    def pieces(self, prompt: str) -> list[int]:
        """The prompt's ids before truncation: pieces then </s>."""
        return [*self._encode(prompt.lower().strip() if self.lower else prompt), self.eos_id]

    def __call__(self, prompts: list[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.full((len(prompts), max_length), self.pad_id, np.int32)
        mask = np.zeros((len(prompts), max_length), np.int32)
        for i, prompt in enumerate(prompts):
            full = self.pieces(prompt)
            if len(full) > max_length:
                dropped = self._decode(full[max_length - 1 : -1])
                warnings.warn(
                    f"prompt {prompt[:40]!r}... has {len(full)} tokens; the text encoder takes "
                    f"{max_length}, so this part was truncated: {dropped!r}",
                    stacklevel=2,
                )
                full = full[: max_length - 1] + [self.eos_id]
            ids[i, : len(full)] = full
            mask[i, : len(full)] = 1
        return ids, mask
