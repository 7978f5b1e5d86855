"""Tokenizers: a byte-level BPE trained on the corpus (cached), or any HF ``tokenizer.json``.

The trained tokenizer is cached under ``$LAYERSHARD_CACHE`` (default ``~/.cache/layershard``),
keyed by the corpus fingerprint and the vocabulary size, so only the first run pays for it;
concurrent launches train it once (``cache.exclusive``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from layershard.train.config import ConfigError
from layershard.train.data.cache import cache_dir, exclusive
from layershard.train.data.sources import PIECE, pieces

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [EOS, PAD, SYSTEM, USER, ASSISTANT]

# Names other tokenizers use for end-of-text, tried in order when no tokenizer_config says.
_EOS_NAMES = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids training needs (end-of-text, padding)."""

    def __init__(self, tok: Tokenizer, path: Path, eos_token: str | None = None) -> None:
        self.tok = tok
        self.path = path
        vocab = tok.get_vocab()
        names = ([eos_token] if eos_token else []) + list(_EOS_NAMES)
        self.eos_token = next((n for n in names if n in vocab), None)
        self.eos_id = vocab.get(self.eos_token) if self.eos_token else None
        self.pad_id = vocab.get(PAD, self.eos_id)
        self.chat_tokens = all(t in vocab for t in (SYSTEM, USER, ASSISTANT))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a text over ``PIECE`` bytes is encoded in pieces cut where the
        pre-tokenizer splits anyway (``sources.cut``), which bounds the tokenizer's memory."""
        if len(text) * 4 <= PIECE:  # at most 4 bytes a character: one piece
            return self.tok.encode(text, add_special_tokens=False).ids
        return [i for ids in self.encode_batch([text]) for i in ids]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        parts = [pieces(t.encode("utf-8")) for t in texts]
        flat = [p.decode("utf-8") for ps in parts for p in ps]
        encoded = iter(self.tok.encode_batch(flat, add_special_tokens=False))
        return [[i for _ in ps for i in next(encoded).ids] for ps in parts]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """Load ``tokenizer.json`` (or a folder holding one, as HF model folders do)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise ConfigError(
            f"tokenizer {path} not found: pass a tokenizer.json file or a folder containing one"
        )
    eos_token = None
    tok_cfg = file.parent / "tokenizer_config.json"
    if tok_cfg.is_file():  # HF folders name their end-of-text token here
        try:
            eos = json.loads(tok_cfg.read_text(encoding="utf-8")).get("eos_token")
        except (ValueError, UnicodeDecodeError, AttributeError) as e:
            raise ConfigError(
                f"{tok_cfg} is not a valid tokenizer_config.json ({e}); fix or remove it"
            ) from None
        eos_token = eos.get("content") if isinstance(eos, dict) else eos
        if eos_token is not None and not isinstance(eos_token, str):
            raise ConfigError(f"{tok_cfg}: eos_token must be a string, got {eos_token!r}")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise ConfigError(
            f"{file} is not a tokenizer.json that the tokenizers library can read ({first}); "
            "pass the tokenizer.json of an HF model folder"
        ) from None
    return TextTokenizer(tok, file, eos_token)


def bpe_cache_path(corpus_hash: str, vocab_size: int) -> Path:
    return cache_dir() / "tokenizers" / f"bpe-v{vocab_size}-{corpus_hash[:16]}.json"


def train_or_load_bpe(
    texts: Callable[[], Iterable[str]], corpus_hash: str, vocab_size: int
) -> tuple[TextTokenizer, bool]:
    """The cached BPE for this corpus and vocabulary size, training it first if needed.
    ``texts`` is called only on a cache miss; it should yield bounded pieces of text (the
    trainer counts pre-tokens, so pieces cut where the pre-tokenizer splits train the same BPE
    as whole documents). Returns (tokenizer, trained_now)."""
    path = bpe_cache_path(corpus_hash, vocab_size)
    if path.is_file():
        return load_tokenizer(path), False
    with exclusive(path.with_name(path.name + ".lock"), "training this BPE"):
        if path.is_file():  # another process trained it while this one waited
            return load_tokenizer(path), False
        return _train_bpe(texts, path, vocab_size), True


def _train_bpe(texts: Callable[[], Iterable[str]], path: Path, vocab_size: int) -> TextTokenizer:
    tok = Tokenizer(models.BPE())
    # Byte-level: every string encodes, no unknown token.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: concurrent runs never read a half-written file.
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return load_tokenizer(path)
