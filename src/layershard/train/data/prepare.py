"""Tokenize a corpus once, streaming, into token files that every rank memory-maps.

Memory stays bounded whatever the corpus size: files are read in blocks (``sources``), text goes
to the tokenizer in pieces of at most ``sources.PIECE`` bytes and tasks of ``TASK_BYTES``, and
tokens are appended to flat ``uint16`` (``uint32`` above 65,536 tokens) files. Large corpora are
tokenized by worker processes (``encode_worker.py``, one per core up to 8), small ones in this
process by the tokenizers library's own threads. The result does not depend on the number of
workers: tokens are written in corpus order.

A prepared corpus is a cache entry ``$LAYERSHARD_CACHE/tokens/<key>/`` (key: corpus fingerprint,
tokenizer, task), built in a temporary folder and renamed into place when complete, under a lock
that makes concurrent launches (nodes sharing a file system) wait for the one that prepares it.
Its ``manifest.json`` records the splits, the absolute paths and fingerprints of the sources
(``fingerprint.corpus_change`` tells whether they changed since), and who prepared it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from tqdm import tqdm

from layershard.train.config import ConfigError, TrainConfig
from layershard.train.data import fingerprint
from layershard.train.data.batches import TokenSplit
from layershard.train.data.cache import (
    cache_dir,
    exclusive,
    publish,
    remove_stale_scratch,
    scratch_dir,
    whoami,
)
from layershard.train.data.sources import (
    Piece,
    name_hash,
    pieces,
    plan_split,
    records,
    source_bytes,
    source_names,
    text_pieces,
)
from layershard.train.data.tokenizer import TextTokenizer

# Bump when what is written, or how the corpus is named, split or cut, changes: old entries
# are then left alone instead of being reused. 3: the held-out share chosen by size.
FORMAT = 3
# The BPE is trained on the training split, or on a deterministic sample of about this many
# bytes of it: the trainer's memory grows with the distinct words it sees (~680 MB for 32 MB
# of the benchmark's prose, ~1 GB for 64 MB).
BPE_SAMPLE = 32 << 20
TASK_BYTES = 1 << 20  # text per tokenizer call
_PROCESSES_FROM = 32 << 20  # smaller corpora: no worker start-up
_MAX_WORKERS = 8
_WORKER = Path(__file__).with_name("encode_worker.py")


def corpus_hash(files: list[Path], cfg: TrainConfig) -> str:
    """The corpus fingerprint with the settings that change how it is read and split (stamps
    of the files, not their whole content: see ``fingerprint``)."""
    return fingerprint.corpus_key(files, source_names(files, cfg), cfg, FORMAT)


def _bar(total: int, desc: str) -> tqdm:
    # On a terminal only (disable=None): a log file gets the summary line instead.
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None, mininterval=1)


# --- the BPE's training text -----------------------------------------------------------------


def bpe_texts(files: list[Path], cfg: TrainConfig) -> Iterator[str]:
    """The BPE's training text: the training split in pieces (so that a 1 GB line is no 1 GB
    string), or for corpora over ``BPE_SAMPLE`` bytes a sample of about that size, drawn by
    document name (spread over the corpus, the same on every machine)."""
    names = source_names(files, cfg)
    plan = plan_split(files, names, cfg)
    total = sum(source_bytes(f) for f in files)
    share = BPE_SAMPLE / total if total > BPE_SAMPLE else 1.0

    def route(name: str) -> str | None:
        if plan.split_of(name) != "train":
            return None
        if share < 1 and name_hash(name + "\0bpe") >= share:
            return None
        return "train"

    if cfg.task == "sft":
        for f, name in zip(files, names):
            if not (f.is_dir() or f.suffix == ".jsonl"):
                raise ConfigError(f"--task sft needs JSONL records, got the text file {f}")
            for doc, rec in records(f, name, cfg):
                if route(doc):  # learn the vocabulary of every message
                    yield from (p.decode("utf-8") for p in pieces(_sft_text(rec).encode()))
        return
    if share < 1:
        print(
            f"training the BPE on a sample of ~{BPE_SAMPLE / 1e6:.0f} MB of the "
            f"{total / 1e6:,.0f} MB corpus",
            flush=True,
        )
    taken = 0
    with _bar(total, "reading the BPE's sample" if share < 1 else "reading") as bar:
        for piece in text_pieces(files, names, cfg, route, bar.update, True, plan.block):
            yield piece.data.decode("utf-8")
            taken += len(piece.data)
            if taken >= 2 * BPE_SAMPLE:  # the sample is drawn at random: bound it for sure
                return


def _sft_text(rec: dict[str, Any]) -> str:
    msgs = rec.get("messages") or [
        {"content": rec.get("prompt", "")},
        {"content": rec.get("response", "")},
    ]
    return "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))


# --- the cache entry -------------------------------------------------------------------------


def _tokenizer_hash(tok: TextTokenizer) -> str:
    return hashlib.sha256(tok.tok.to_str().encode()).hexdigest()


def prepare_splits(
    files: list[Path], cfg: TrainConfig, tok: TextTokenizer, chash: str
) -> dict[str, Any]:
    """The tokenized corpus, prepared now or by an earlier (or concurrent) launch. Returns the
    manifest: {"train": TokenSplit dict, "val": ..., "docs": {...}, "sources": [...], ...}."""
    final = entry_folder(cfg, tok, chash)
    manifest = load_entry(final)
    if manifest is not None:
        return manifest
    with exclusive(lock_path(final), "tokenizing this corpus"):
        manifest = load_entry(final)  # prepared by the process this one waited for
        if manifest is not None:
            return manifest
        if final.exists():  # incomplete or of another format: never used, rebuilt
            shutil.rmtree(final)
        remove_stale_scratch(final)
        tmp = scratch_dir(final)
        try:
            _prepare(files, cfg, tok, tmp, final.name)
            publish(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            full = _disk_full(e, final.parent, files, tok)
            if full:
                raise ConfigError(full) from None
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    manifest = load_entry(final)
    assert manifest is not None, f"{final} was just written but does not load"
    return manifest


def _disk_full(e: OSError, folder: Path, files: list[Path], tok: TextTokenizer) -> str:
    """One line for a write that found the disk full (ENOSPC, a quota, or numpy's short write
    "N requested and M written", which carries no errno), naming the folder and the space the
    tokenized corpus needs; '' for any other error."""
    short = e.errno is None and "requested and" in str(e) and "written" in str(e)
    if e.errno not in (errno.ENOSPC, errno.EDQUOT) and not short:
        return ""
    # at most one token per byte (a byte-level BPE), 2 or 4 bytes each, plus a mask for SFT
    size = sum(source_bytes(f) for f in files)
    need = size * ((2 if tok.vocab_size <= 2**16 else 4) + 1)
    try:
        free = f"{shutil.disk_usage(folder).free / 1e6:,.0f} MB free"
    except OSError:
        free = "free space unknown"
    return (
        f"the disk holding {folder} is full ({free}): the tokenized corpus needs up to "
        f"{need / 1e6:,.0f} MB there (a {size / 1e6:,.1f} MB corpus); free space on it, or set "
        "LAYERSHARD_CACHE to a folder on a larger disk. Nothing was cached"
    )


def entry_folder(cfg: TrainConfig, tok: TextTokenizer, chash: str) -> Path:
    """The cache entry of a corpus (fingerprint ``chash``) tokenized by ``tok`` for ``cfg``."""
    key = f"{chash[:16]}-{_tokenizer_hash(tok)[:12]}-{cfg.task}"
    if cfg.task == "sft":
        key += f"-{cfg.sft_packing}-{cfg.seq_len}"
    return cache_dir() / "tokens" / key


def lock_path(entry: Path) -> Path:
    return entry.with_name(entry.name + ".lock")


def load_entry(folder: Path) -> dict[str, Any] | None:
    """A complete cache entry's manifest with absolute file paths, or None (missing, another
    format, or files not of the recorded sizes)."""
    try:
        m = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        return None
    try:
        for split in ("train", "val"):
            s = m[split]
            itemsize = np.dtype(s["dtype"]).itemsize
            for k, size in (("tokens_path", itemsize), ("mask_path", 1)):
                if s[k] is None:
                    continue
                path = folder / s[k]
                if not path.is_file() or path.stat().st_size != s["n_tokens"] * size:
                    return None
                s[k] = str(path)
    except (KeyError, TypeError, ValueError):  # a manifest that is not one of ours
        return None
    m["cache"] = str(folder)
    return m


# --- tokenizing ------------------------------------------------------------------------------


class _Writer:
    def __init__(self, folder: Path, split: str, dtype: str, with_mask: bool) -> None:
        self.folder, self.dtype = folder, dtype
        self.tokens = f"{split}.bin"
        self.mask = f"{split}.mask" if with_mask else None
        self.fh: BinaryIO = open(folder / self.tokens, "wb")  # noqa: SIM115 - closed in close()
        self.mask_fh = open(folder / self.mask, "wb") if self.mask else None  # noqa: SIM115
        self.n = 0

    def write(self, ids: np.ndarray | list[int], mask: list[int] | None = None) -> None:
        np.asarray(ids, dtype=self.dtype).tofile(self.fh)
        if self.mask_fh is not None:
            np.asarray(mask, dtype=np.uint8).tofile(self.mask_fh)
        self.n += len(ids)

    def close(self) -> dict[str, Any]:
        self.fh.close()
        if self.mask_fh is not None:
            self.mask_fh.close()
        return TokenSplit(Path(self.tokens), Path(self.mask) if self.mask else None,
                          self.dtype, self.n).to_dict()  # fmt: skip


def workers_for(total_bytes: int) -> int:
    """Tokenizer processes for a corpus: none (this process) below 32 MB or on one core, else
    one per core up to 8; ``$LAYERSHARD_PREPARE_WORKERS`` overrides (0: this process)."""
    env = os.environ.get("LAYERSHARD_PREPARE_WORKERS")
    if env:
        return max(0, int(env))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = min(_MAX_WORKERS, cores or 1)
    return n if n > 1 and total_bytes >= _PROCESSES_FROM else 0


def _prepare(files: list[Path], cfg: TrainConfig, tok: TextTokenizer, tmp: Path, key: str) -> None:
    t0 = time.perf_counter()
    names = source_names(files, cfg)
    plan = plan_split(files, names, cfg)
    sources = fingerprint.record(files)
    total = sum(source_bytes(f) for f in files)
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    sft = cfg.task == "sft"
    writers = {s: _Writer(tmp, s, dtype, with_mask=sft) for s in ("train", "val")}
    docs = {"train": 0, "val": 0}
    n_workers = 0
    with _bar(total, "tokenizing") as bar:
        if sft:
            _prepare_sft(files, names, cfg, tok, plan.split_of, writers, docs, bar)
        else:
            tok.save(tmp / "tokenizer.json")
            n_workers = workers_for(total)
            encoder = (
                ProcessEncoder(tmp / "tokenizer.json", n_workers, dtype)
                if n_workers
                else LocalEncoder(tok, dtype)
            )
            stream = text_pieces(files, names, cfg, plan.split_of, bar.update, False, plan.block)
            eos = [] if tok.eos_id is None else [tok.eos_id]
            with encoder:
                for task, encoded in encoder.map(_tasks(stream)):
                    for piece, ids in zip(task, encoded):
                        writers[piece.split].write(ids)
                        if piece.end:
                            writers[piece.split].write(eos)
                            docs[piece.split] += 1
    seconds = time.perf_counter() - t0
    splits = {s: w.close() for s, w in writers.items()}
    _unchanged(sources, files)
    manifest: dict[str, Any] = splits | {
        "format": FORMAT,
        "key": key,
        "docs": docs,
        "bytes": total,
        "split": {
            "val_fraction": cfg.val_fraction,
            "block_bytes": plan.block,
            "by": "size" if plan.val is not None else "hash",
            "val_bytes_share": plan.share,
        },
        "sources": sources,
        "prepared_by": whoami(),
        "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": round(seconds, 2),
        "workers": n_workers,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    rate = total / max(seconds, 1e-9) / 1e6
    how = f"{n_workers} processes" if n_workers else "in this process"
    print(
        f"tokenized {total / 1e6:.1f} MB in {seconds:.1f} s ({rate:.2f} MB/s, {how}): "
        f"{splits['train']['n_tokens']:,} training and {splits['val']['n_tokens']:,} "
        "validation tokens",
        flush=True,
    )


def _unchanged(before: list[dict[str, Any]], files: list[Path]) -> None:
    """Refuse a corpus whose files changed while they were tokenized (rewritten in place, grown,
    truncated): the tokens would match neither version. ``before`` is what preparation recorded
    (each file's size and full hash) before reading them."""
    for was, now in zip(before, fingerprint.record(files)):
        if (was["path"], was["size"], was["sha256"]) != (now["path"], now["size"], now["sha256"]):
            size = f"size {was['size']} -> {now['size']}" if was["size"] != now["size"] else (
                "same size, other content")  # fmt: skip
            raise ConfigError(
                f"{now['path']} changed while it was being tokenized ({size}); nothing was "
                "cached. Run again once nothing writes to the corpus (or copy it first)"
            )
    if len(before) != len(fingerprint.leaves(files)):
        raise ConfigError("the corpus changed while it was being tokenized (files came or went); "
                          "nothing was cached. Run again once nothing writes to it")  # fmt: skip


def _prepare_sft(
    files: list[Path],
    names: list[str],
    cfg: TrainConfig,
    tok: TextTokenizer,
    split_of: Callable[[str], str],
    writers: dict[str, _Writer],
    docs: dict[str, int],
    bar: tqdm,
) -> None:
    from layershard.train.data import sft

    for f, name in zip(files, names):
        if not (f.is_dir() or f.suffix == ".jsonl"):
            raise ConfigError(f"--task sft needs JSONL records, got the text file {f}")
        for doc, rec in records(f, name, cfg):
            ids, mask = sft.encode_example(rec, tok, where=doc)
            if cfg.sft_packing == "pad":
                # the launcher refuses sft without an end-of-text token, pad's fallback
                assert tok.pad_id is not None, "sft needs a padding or end-of-text token"
                ids, mask = sft.pad_or_truncate(ids, mask, cfg.seq_len, tok.pad_id)
            split = split_of(doc)
            writers[split].write(ids, mask)
            docs[split] += 1
        bar.update(source_bytes(f))


def _tasks(stream: Iterable[Piece]) -> Iterator[list[Piece]]:
    task: list[Piece] = []
    size = 0
    for piece in stream:
        if task and size + len(piece.data) > TASK_BYTES:
            yield task
            task, size = [], 0
        task.append(piece)
        size += len(piece.data)
    if task:
        yield task


class LocalEncoder:
    """Encodes in this process (the tokenizers library's threads)."""

    def __init__(self, tok: TextTokenizer, dtype: str) -> None:
        self.tok, self.dtype = tok.tok, dtype

    def __enter__(self) -> LocalEncoder:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def map(self, tasks: Iterable[list[Piece]]) -> Iterator[tuple[list[Piece], list[np.ndarray]]]:
        for task in tasks:
            texts = [p.data.decode("utf-8") for p in task]
            encoded = self.tok.encode_batch(texts, add_special_tokens=False)
            yield task, [np.asarray(e.ids, dtype=self.dtype) for e in encoded]


class ProcessEncoder:
    """Encodes in ``n`` worker processes, one task in flight each, results in task order.

    One task per worker keeps the pipes from deadlocking (a worker only writes a reply after
    reading a whole request, and this process reads the oldest reply before sending that
    worker another task) and bounds memory: n tasks of ``TASK_BYTES`` of text at a time."""

    def __init__(self, tokenizer_file: Path, n: int, dtype: str) -> None:
        self.dtype = np.dtype(dtype).newbyteorder("<")
        # one thread each: the processes are the parallelism
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-P", str(_WORKER), str(tokenizer_file), dtype]
        self.procs = [
            subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            for _ in range(n)
        ]

    def __enter__(self) -> ProcessEncoder:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:  # the workers may be mid-reply: nobody will read it
            for p in self.procs:
                p.kill()
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.write(struct.pack("<I", 0))
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _send(self, p: subprocess.Popen, task: list[Piece]) -> None:
        assert p.stdin is not None
        lengths = np.asarray([len(x.data) for x in task], dtype="<u8")
        try:
            p.stdin.write(struct.pack("<I", len(task)) + lengths.tobytes())
            for x in task:
                p.stdin.write(x.data)
            p.stdin.flush()
        except BrokenPipeError:
            self._died(p)

    def _receive(self, p: subprocess.Popen, n: int) -> list[np.ndarray]:
        assert p.stdout is not None
        head = p.stdout.read(8 * n)
        if len(head) != 8 * n:
            self._died(p)
        counts = np.frombuffer(head, dtype="<u8")
        size = int(counts.sum()) * self.dtype.itemsize
        body = p.stdout.read(size)
        if len(body) != size:
            self._died(p)
        ids = np.frombuffer(body, dtype=self.dtype)
        return np.split(ids, np.cumsum(counts)[:-1].astype(np.int64))

    def _died(self, p: subprocess.Popen) -> None:
        raise RuntimeError(
            f"a tokenizer process (pid {p.pid}) exited with code {p.wait()} while preparing "
            "the corpus (killed for memory?); see its error above"
        )

    def map(self, tasks: Iterable[list[Piece]]) -> Iterator[tuple[list[Piece], list[np.ndarray]]]:
        it = iter(tasks)
        inflight: deque[tuple[subprocess.Popen, list[Piece]]] = deque()
        for p in self.procs:
            task = next(it, None)
            if task is None:
                break
            self._send(p, task)
            inflight.append((p, task))
        while inflight:
            p, task = inflight.popleft()
            result = self._receive(p, len(task))
            following = next(it, None)  # read the corpus while the others tokenize
            if following is not None:
                self._send(p, following)
                inflight.append((p, following))
            yield task, result
