"""From files to batches: find the corpus, split it, tokenize it once (cached), and serve each rank
its share of every step in an order fixed by the seed.

Documents are text files, JSONL records or rows of a ``datasets`` folder. A document goes to the
validation split when a hash of its name falls below ``val_fraction``: stable and deterministic.
Tokenized splits are flat token files (plus a loss mask for SFT) that ranks memory-map; sequences
are the consecutive ``seq_len`` windows of that stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from layershard.train.config import ConfigError, TrainConfig
from layershard.train.tokenizer import TextTokenizer, cache_dir

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl"}
# Skipped: the stdlib's test suites (odd encodings, huge data files), codec tables (encodings/)
# and pydoc's help text (pydoc_data/), which are data rather than code; site-packages is not stdlib.
_STDLIB_SKIP = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
    "encodings", "pydoc_data",
}  # fmt: skip


def stdlib_files() -> list[Path]:
    """The default corpus: the Python standard library's own source files, present offline."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if not _STDLIB_SKIP & set(p.relative_to(root).parts[:-1]) and p.is_file()
    )


def find_files(cfg: TrainConfig) -> list[Path]:
    """The source files of the corpus, sorted; ``max_files`` keeps the first N."""
    if not cfg.data:
        files = stdlib_files()
    else:
        files = []
        for entry in cfg.data:
            p = Path(entry).expanduser()
            if not p.exists():
                raise ConfigError(
                    f"data path {entry} does not exist; pass existing files or folders to --data"
                )
            if p.is_dir() and _is_datasets_folder(p):
                files.append(p)
            elif p.is_dir():
                files.extend(
                    sorted(
                        f
                        for f in p.rglob("*")
                        if f.is_file()
                        and f.suffix in TEXT_SUFFIXES
                        and not any(part.startswith(".") for part in f.relative_to(p).parts)
                    )
                )
            else:
                files.append(p)
    if cfg.max_files is not None:
        files = files[: cfg.max_files]
    if not files:
        where = ", ".join(cfg.data) if cfg.data else "the Python standard library"
        raise ConfigError(
            f"the corpus is empty: no {'/'.join(sorted(TEXT_SUFFIXES))} files in {where}; "
            "point --data at text or JSONL files"
        )
    return files


def _is_datasets_folder(p: Path) -> bool:
    return (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file()


def iter_documents(files: list[Path], cfg: TrainConfig) -> Iterator[tuple[str, Any]]:
    """(stable name, document) pairs: a str for pre-training, a dict record for SFT."""
    for f in files:
        if f.is_dir():  # a `datasets` folder saved with save_to_disk
            yield from _iter_datasets(f, cfg)
        elif f.suffix == ".jsonl":
            for i, line in enumerate(_text_lines(f)):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{f}:{i + 1} is not valid JSON ({e.msg})") from e
                yield f"{f.name}:{i}", _record(rec, cfg, f"{f}:{i + 1}")
        else:
            if cfg.task == "sft":
                raise ConfigError(f"--task sft needs JSONL records, got the text file {f}")
            yield f.name if not cfg.data else str(f), read_text(f)


def _not_text(f: Path, data: bytes) -> ConfigError | None:
    """Why ``data`` (the bytes of ``f``) is not UTF-8 text, as an error naming the place."""
    nul = data.find(b"\x00")
    if nul >= 0:
        return ConfigError(
            f"{f} is a binary file (a NUL byte at offset {nul}), not text; leave it out of --data"
        )
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return ConfigError(
            f"{f}:{line} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); convert "
            "the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out of --data"
        )
    return None


def read_text(f: Path) -> str:
    """A corpus file's text. Binary or non-UTF-8 files are an error: training on replacement
    characters would be silent garbage."""
    data = f.read_bytes()
    err = _not_text(f, data)
    if err is not None:
        raise err
    return data.decode("utf-8")


def _text_lines(f: Path) -> Iterator[str]:
    with f.open("rb") as fh:
        for i, raw in enumerate(fh):
            err = _not_text(f, raw)
            if err is not None:  # the line number of the file, not of the line
                raise ConfigError(str(err).replace(f"{f}:1 ", f"{f}:{i + 1} ", 1)) from None
            yield raw.decode("utf-8")


def _iter_datasets(path: Path, cfg: TrainConfig) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            f"{path} is a `datasets` folder; install the datasets package to read it"
        ) from e
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    for i, rec in enumerate(ds):
        yield f"{path.name}:{i}", _record(rec, cfg, f"{path} row {i}")


def _record(rec: Any, cfg: TrainConfig, where: str) -> Any:
    if cfg.task == "sft":
        from layershard.train.sft import messages_of

        messages_of(rec, where)  # a malformed record is named here, with its file and line
        return rec
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict) or cfg.text_key not in rec:
        raise ConfigError(
            f"{where} has no '{cfg.text_key}' field; set --text-key to the field holding the text"
        )
    text = rec[cfg.text_key]
    if not isinstance(text, str):
        what = "null" if text is None else f"a {type(text).__name__}, not a string"
        raise ConfigError(f"{where}: '{cfg.text_key}' is {what}; fix or remove the record")
    return text


def _name_hash(name: str) -> float:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def is_val(name: str, val_fraction: float) -> bool:
    return _name_hash(name) < val_fraction


def document_names(files: list[Path], cfg: TrainConfig) -> Iterator[str]:
    """The names ``iter_documents`` gives, without parsing the documents."""
    for f in files:
        if f.is_dir():
            yield from (name for name, _ in _iter_datasets(f, cfg))
        elif f.suffix == ".jsonl":
            yield from (f"{f.name}:{i}" for i, line in enumerate(_text_lines(f)) if line.strip())
        else:
            yield f.name if not cfg.data else str(f)


def val_names(files: list[Path], cfg: TrainConfig) -> set[str]:
    """Documents held out for validation: those whose name hashes below ``val_fraction``, or the
    lowest-hashing one when that picks none (small corpora still get a validation split)."""
    if cfg.val_fraction <= 0:
        return set()
    names = list(document_names(files, cfg))
    chosen = {n for n in names if is_val(n, cfg.val_fraction)}
    if not chosen and len(names) > 1:
        chosen = {min(names, key=_name_hash)}
    return chosen


# Above this size the corpus is identified by names, sizes and modification times: reading
# every byte on each launch would cost more than it is worth.
CONTENT_HASH_LIMIT = 1 << 30


def corpus_hash(files: list[Path], cfg: TrainConfig) -> str:
    """Hash of the corpus and of the settings that change how it is read and split."""
    h = hashlib.sha256()
    h.update(json.dumps([cfg.task, cfg.text_key, cfg.val_fraction, bool(cfg.data)]).encode())
    leaves: list[Path] = []
    for f in files:
        subs = sorted(s for s in f.rglob("*") if s.is_file()) if f.is_dir() else [f]
        leaves += subs
    by_content = sum(s.stat().st_size for s in leaves) <= CONTENT_HASH_LIMIT
    for s in leaves:
        h.update(str(s.name if not cfg.data else s).encode())
        if by_content:
            h.update(s.read_bytes())
        else:
            st = s.stat()
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


# --- tokenized splits ------------------------------------------------------------------------


@dataclass
class TokenSplit:
    """A tokenized split on disk: ``tokens`` (and for SFT a 0/1 ``mask``; 1 = trained on)."""

    tokens_path: Path
    mask_path: Path | None
    dtype: str
    n_tokens: int

    def open(self) -> tuple[np.ndarray, np.ndarray | None]:
        tokens = np.memmap(self.tokens_path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        mask = None
        if self.mask_path is not None:
            mask = np.memmap(self.mask_path, dtype=np.uint8, mode="r", shape=(self.n_tokens,))
        return tokens, mask

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens_path": str(self.tokens_path),
            "mask_path": str(self.mask_path) if self.mask_path else None,
            "dtype": self.dtype,
            "n_tokens": self.n_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenSplit:
        mask = Path(d["mask_path"]) if d.get("mask_path") else None
        return cls(Path(d["tokens_path"]), mask, d["dtype"], int(d["n_tokens"]))


def _tokenizer_hash(tok: TextTokenizer) -> str:
    return hashlib.sha256(tok.tok.to_str().encode()).hexdigest()


def prepare_splits(
    files: list[Path], cfg: TrainConfig, tok: TextTokenizer, chash: str
) -> dict[str, Any]:
    """Tokenize the corpus into train/val token files once; later runs reuse the cache.
    Returns a manifest {"train": TokenSplit dict, "val": ..., "docs": {...}}."""
    from layershard.train import sft

    key = f"{chash[:16]}-{_tokenizer_hash(tok)[:12]}-{cfg.task}"
    if cfg.task == "sft":
        key += f"-{cfg.sft_packing}-{cfg.seq_len}"
    folder = cache_dir() / "tokens" / key
    manifest_path = folder / "manifest.json"
    if manifest_path.is_file():
        return json.loads(manifest_path.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    dtype = "uint16" if tok.vocab_size <= 2**16 else "int32"
    writers = {
        s: _SplitWriter(folder, s, dtype, with_mask=cfg.task == "sft") for s in ("train", "val")
    }
    docs = {"train": 0, "val": 0}
    batch: list[tuple[str, Any]] = []
    held_out = val_names(files, cfg)

    def flush() -> None:
        if cfg.task == "sft":
            for name, rec in batch:
                ids, mask = sft.encode_example(rec, tok, where=name)
                if cfg.sft_packing == "pad":
                    # the launcher refuses sft without an end-of-text token, pad's fallback
                    assert tok.pad_id is not None, "sft needs a padding or end-of-text token"
                    ids, mask = sft.pad_or_truncate(ids, mask, cfg.seq_len, tok.pad_id)
                split = "val" if name in held_out else "train"
                writers[split].write(ids, mask)
                docs[split] += 1
        else:
            encoded = tok.encode_batch([text for _, text in batch])
            for (name, _), ids in zip(batch, encoded):
                if tok.eos_id is not None:  # documents end with end-of-text
                    ids = ids + [tok.eos_id]
                split = "val" if name in held_out else "train"
                writers[split].write(ids, None)
                docs[split] += 1
        batch.clear()

    for doc in iter_documents(files, cfg):
        if isinstance(doc[1], str) and not doc[1].strip():
            continue  # an empty document adds nothing but an end-of-text token
        batch.append(doc)
        if len(batch) >= 256:
            flush()
    flush()
    manifest = {s: w.close().to_dict() for s, w in writers.items()} | {"docs": docs, "key": key}
    tmp = manifest_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, manifest_path)  # the manifest appears last: its presence means complete
    return manifest


class _SplitWriter:
    def __init__(self, folder: Path, split: str, dtype: str, with_mask: bool) -> None:
        self.final = folder / f"{split}.bin"
        self.tmp = folder / f"{split}.bin.tmp{os.getpid()}"
        self.fh = self.tmp.open("wb")
        self.mask_final = folder / f"{split}.mask" if with_mask else None
        self.mask_tmp = folder / f"{split}.mask.tmp{os.getpid()}" if with_mask else None
        self.mask_fh = self.mask_tmp.open("wb") if self.mask_tmp else None
        self.dtype = dtype
        self.n = 0

    def write(self, ids: list[int], mask: list[int] | None) -> None:
        np.asarray(ids, dtype=self.dtype).tofile(self.fh)
        if self.mask_fh is not None:
            np.asarray(mask, dtype=np.uint8).tofile(self.mask_fh)
        self.n += len(ids)

    def close(self) -> TokenSplit:
        self.fh.close()
        os.replace(self.tmp, self.final)
        if self.mask_fh is not None:
            assert self.mask_tmp is not None and self.mask_final is not None  # set with mask_fh
            self.mask_fh.close()
            os.replace(self.mask_tmp, self.mask_final)
        return TokenSplit(self.final, self.mask_final, self.dtype, self.n)


# --- serving batches -------------------------------------------------------------------------


class BatchLoader:
    """Each optimizer step consumes ``micro_batch * grad_accum * world_size`` windows taken in
    the order of a seeded permutation (a new one each epoch; an incomplete last batch of an
    epoch is dropped). Rank r takes its own slice of the step's windows, and reads only those.

    The global order does not depend on the world size, and ``state_dict()`` (epoch, cursor) is
    all it takes to continue exactly where a run stopped.
    """

    def __init__(
        self,
        split: TokenSplit,
        seq_len: int,
        micro_batch: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        seed: int,
    ) -> None:
        self.tokens, self.mask = split.open()
        self.seq_len, self.micro_batch, self.grad_accum = seq_len, micro_batch, grad_accum
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.n_windows = split.n_tokens // seq_len
        self.global_batch = micro_batch * grad_accum * world_size
        if self.n_windows < self.global_batch:
            raise ConfigError(
                f"the training split has {self.n_windows} sequences of {seq_len} tokens but one "
                f"step needs {self.global_batch}; add data or lower --seq-len / --micro-batch"
            )
        self.epoch, self.cursor = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm, self._perm_epoch = rng.permutation(self.n_windows), self.epoch
        return self._perm

    def step_windows(self) -> list[np.ndarray]:
        """Window indices of this rank's micro-batches for the next step (does not advance)."""
        epoch, cursor = self.epoch, self.cursor
        if cursor + self.global_batch > self.n_windows:
            epoch, cursor = epoch + 1, 0
        saved = self.epoch
        self.epoch = epoch
        perm = self._permutation()
        self.epoch = saved
        out = []
        for m in range(self.grad_accum):
            start = cursor + (m * self.world_size + self.rank) * self.micro_batch
            out.append(perm[start : start + self.micro_batch])
        return out

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (input_ids, labels) micro-batches for the next step; advances."""
        windows = self.step_windows()
        if self.cursor + self.global_batch > self.n_windows:
            self.epoch, self.cursor = self.epoch + 1, 0
        self.cursor += self.global_batch
        return [self.read(w) for w in windows]

    def read(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return read_windows(self.tokens, self.mask, windows, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "seq_len": self.seq_len, "global_batch": self.global_batch}  # fmt: skip

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k in ("seed", "seq_len", "global_batch"):
            if k in state and state[k] != getattr(self, k):
                raise ConfigError(
                    f"the checkpoint's data loader has {k}={state[k]} but this run has "
                    f"{getattr(self, k)}; resume with the same --seed / --seq-len / global batch"
                )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def read_windows(
    tokens: np.ndarray, mask: np.ndarray | None, windows: np.ndarray, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [np.asarray(tokens[i * seq_len : (i + 1) * seq_len], dtype=np.int64) for i in windows]
    ids = torch.from_numpy(np.stack(rows))
    labels = ids.clone()
    if mask is not None:
        m = np.stack([np.asarray(mask[i * seq_len : (i + 1) * seq_len]) for i in windows])
        labels[torch.from_numpy(m) == 0] = -100
    return ids, labels


def eval_windows(split: TokenSplit, seq_len: int, n_sequences: int, per_round: int) -> np.ndarray:
    """Fixed validation windows, spread over the split; a multiple of ``per_round`` (ranks x
    micro-batch) so that every rank runs the same number of forward passes."""
    n_windows = split.n_tokens // seq_len
    if n_windows == 0 or n_sequences <= 0:
        return np.empty(0, dtype=np.int64)
    n = max(per_round, (n_sequences // per_round) * per_round)
    # Evenly spaced over the split; wraps around when the split is small.
    return (np.arange(n, dtype=np.int64) * max(1, n_windows // n)) % n_windows
