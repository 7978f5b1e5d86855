"""The corpus as a stream of named documents, read in bounded pieces, and their train/val split.

Documents are JSONL records, rows of a ``datasets`` folder, and *blocks* of text files: a text
file is cut into blocks of about ``SPLIT_BLOCK`` bytes at line starts, so that a large file (or a
corpus that is one file) is split within itself. Each document goes to validation when a hash of
its name falls below ``val_fraction``. Names do not depend on where the corpus lies or how its
path was written: a file's name is its path relative to its ``--data`` entry (a file entry's own
name; for the default corpus, the file name), block k > 0 of a file is ``name#k`` and record i is
``name:i``. A file's block 0 keeps the file's name, so files smaller than a block split as they
did when whole files were the documents.

Consecutive blocks of a file that land in the same split are one document there: its text is
tokenized as a whole and ends with one end-of-text token. Long texts are handed to the tokenizer
in pieces of at most ``PIECE`` bytes, cut where the byte-level BPE's pre-tokenizer splits anyway
(see ``cut``), so the tokens are those of the whole text.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layershard.train.config import ConfigError, TrainConfig

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl"}
# Skipped: the stdlib's test suites (odd encodings, huge data files), codec tables (encodings/)
# and pydoc's help text (pydoc_data/), which are data rather than code; site-packages is not stdlib.
_STDLIB_SKIP = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
    "encodings", "pydoc_data",
}  # fmt: skip

# A text file's documents for the split. Larger than every file of the default corpus (the
# stdlib's largest is 229 KB), so that corpus splits by whole files, as before.
SPLIT_BLOCK = 256 << 10
# The most text given to the tokenizer at once. HF tokenizers hold ~100-200 bytes per byte of
# text while encoding it (offsets, token strings, alignments): 256 KiB stay near 40 MB.
PIECE = 256 << 10


def stdlib_files() -> list[Path]:
    """The default corpus: the Python standard library's own source files, present offline."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if not _STDLIB_SKIP & set(p.relative_to(root).parts[:-1]) and p.is_file()
    )


def _abs(p: str | Path) -> Path:
    return Path(os.path.abspath(Path(p).expanduser()))


def find_files(cfg: TrainConfig, notes: list[str] | None = None) -> list[Path]:
    """The source files of the corpus as absolute paths, sorted within each ``--data`` entry;
    empty files are left out (``notes`` gets a line naming them); ``max_files`` keeps the first
    N of the rest."""
    if not cfg.data:
        files = stdlib_files()
    else:
        files = []
        for entry in cfg.data:
            p = _abs(entry)
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
        empty = [f for f in files if f.is_file() and f.stat().st_size == 0]
        if empty:
            skip = set(empty)
            files = [f for f in files if f not in skip]
            if notes is not None:
                shown = ", ".join(str(f) for f in empty[:3])
                more = f" and {len(empty) - 3} more" if len(empty) > 3 else ""
                notes.append(f"skipped {len(empty)} empty file(s) of the corpus: {shown}{more}")
    if cfg.max_files is not None:
        files = files[: cfg.max_files]
    if not files:
        where = ", ".join(cfg.data) if cfg.data else "the Python standard library"
        raise ConfigError(
            f"the corpus is empty: no {'/'.join(sorted(TEXT_SUFFIXES))} files in {where}; "
            "point --data at text or JSONL files"
        )
    return files


def source_bytes(f: Path) -> int:
    """Bytes of a corpus file, or of all files of a ``datasets`` folder."""
    if f.is_dir():
        return sum(s.stat().st_size for s in f.rglob("*") if s.is_file())
    return f.stat().st_size


def _is_datasets_folder(p: Path) -> bool:
    return (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file()


def source_names(files: list[Path], cfg: TrainConfig) -> list[str]:
    """Each file's name for the split: relative to the ``--data`` entry it was found in."""
    if not cfg.data:
        return [f.name for f in files]
    entries = [_abs(e) for e in cfg.data]
    names = []
    for f in files:
        name = f.name
        for e in entries:
            if f == e:
                break
            if f.is_relative_to(e):
                name = f.relative_to(e).as_posix()
                break
        names.append(name)
    return names


# --- the split -------------------------------------------------------------------------------


def name_hash(name: str) -> float:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def is_val(name: str, val_fraction: float) -> bool:
    return name_hash(name) < val_fraction


def block_name(name: str, k: int) -> str:
    return name if k == 0 else f"{name}#{k}"


def n_blocks(size: int, block: int = SPLIT_BLOCK) -> int:
    return max(1, -(-size // block))


# The held-out share is chosen by size for corpora of up to this many documents; larger ones
# split by each name's hash alone (close to the fraction by their number).
_MAX_PLANNED = 100_000
# How far the held-out bytes may be from val_fraction of the corpus (relative), or half of the
# smallest block, before text files are cut into blocks small enough to come closer.
_SPLIT_TOL = 0.25
MIN_BLOCK = 1 << 10


@dataclass(frozen=True)
class SplitPlan:
    """Which split each document goes to. Text files are cut into blocks of ``block`` bytes
    (``SPLIT_BLOCK``, or less for a corpus too small for ``val_fraction`` at that size).

    A corpus of up to ``_MAX_PLANNED`` documents holds out about ``val_fraction`` of its bytes:
    documents in the order of their name's hash, each taken while it brings the held-out bytes
    closer to the target (``val``), so which documents are held out looks random but the share
    does not; when even that cannot come close (a few large documents), text files are cut
    finer. A corpus of two or more documents always has both splits; one of a single document
    small enough to miss the target by less than half a ``MIN_BLOCK`` trains on it. Larger
    corpora hold out the documents whose name hashes below ``val_fraction``."""

    val_fraction: float
    block: int = SPLIT_BLOCK
    val: frozenset[str] | None = None  # the held-out documents, when chosen by size
    share: float | None = None  # their planned share of the corpus' bytes

    def split_of(self, name: str) -> str:
        if self.val is not None:
            return "val" if name in self.val else "train"
        return "val" if is_val(name, self.val_fraction) else "train"


def plan_split(files: list[Path], names: list[str], cfg: TrainConfig) -> SplitPlan:
    """The split of this corpus. Text files are measured by their size; JSONL files are read
    line by line (once more than preparation reads them), until ``_MAX_PLANNED`` documents."""
    vf = cfg.val_fraction
    if vf <= 0:
        return SplitPlan(vf)
    units = _units(files, names, cfg, SPLIT_BLOCK)
    if units is None:
        return SplitPlan(vf)
    total = sum(size for _, size in units)
    val, got = _held_out(units, vf * total)
    if abs(got - vf * total) > max(_SPLIT_TOL * vf * total, MIN_BLOCK / 2):
        block = max(MIN_BLOCK, min(SPLIT_BLOCK, int(vf * total / 4)))
        finer = _units(files, names, cfg, block) if block < SPLIT_BLOCK else None
        if finer is not None:
            val, got = _held_out(finer, vf * total)
            return SplitPlan(vf, block, frozenset(val), got / max(total, 1))
    return SplitPlan(vf, SPLIT_BLOCK, frozenset(val), got / max(total, 1))


def _held_out(units: list[tuple[str, int]], target: float) -> tuple[list[str], int]:
    """Documents in the order of their name's hash, each held out while it brings the held-out
    bytes closer to ``target``; with two or more documents, at least one of each split."""
    order = sorted(units, key=lambda u: name_hash(u[0]))
    val, got = [], 0
    for name, size in order:
        if got + size / 2 <= target:
            val.append(name)
            got += size
    filled = [u for u in order if u[1] > 0]
    if len(units) > 1 and filled and not got:
        name, size = min(filled, key=lambda u: abs(u[1] - target))  # the closest to the target
        val, got = [*val, name], got + size
    if units and len(val) == len(units):  # one document, or val_fraction near 1
        got -= dict(units)[val.pop()]
    return val, got


def _units(
    files: list[Path], names: list[str], cfg: TrainConfig, block: int
) -> list[tuple[str, int]] | None:
    """(name, bytes) of every document, text files cut into ``block``-byte blocks (sizes
    estimated from the file's); None beyond ``_MAX_PLANNED`` documents."""
    out: list[tuple[str, int]] = []
    for f, name in zip(files, names):
        if f.is_dir():
            rows = len(_load_datasets(f))
            out += [(f"{name}:{i}", source_bytes(f) // max(rows, 1)) for i in range(rows)]
        elif f.suffix == ".jsonl":
            out += [(f"{name}:{i}", len(line)) for i, line in enumerate(_lines(f)) if line.strip()]
        else:
            size = f.stat().st_size
            n = n_blocks(size, block)
            out += [(block_name(name, k), min(block, size - k * block)) for k in range(n)]
        if len(out) > _MAX_PLANNED:
            return None
    return out


# --- reading ---------------------------------------------------------------------------------


def _not_text(f: Path, data: bytes, offset: int = 0, line0: int = 1) -> ConfigError | None:
    """Why ``data`` (bytes of ``f`` from ``offset``, starting on line ``line0``) is not UTF-8
    text, as an error naming the place."""
    nul = data.find(b"\x00")
    if nul >= 0:
        return ConfigError(
            f"{f} is a binary file (a NUL byte at offset {offset + nul}), not text; "
            "leave it out of --data"
        )
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line0 + data.count(b"\n", 0, e.start)
        return ConfigError(
            f"{f}:{line} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {offset + e.start}); "
            "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out of --data"
        )
    return None


def _lines(f: Path) -> Iterator[bytes]:
    with f.open("rb") as fh:
        yield from fh


def text_lines(f: Path) -> Iterator[str]:
    """A JSONL file's lines, each checked to be UTF-8 text."""
    offset = 0
    for i, raw in enumerate(_lines(f)):
        err = _not_text(f, raw, offset, i + 1)
        if err is not None:
            raise err
        offset += len(raw)
        yield raw.decode("utf-8")


@dataclass
class Block:
    k: int
    data: bytes  # UTF-8, checked


def text_blocks(f: Path, block: int = SPLIT_BLOCK) -> Iterator[Block]:
    """A text file as its split blocks, read sequentially with at most ~3 blocks in memory.
    Block k > 0 starts at the first line start in [kB, (k+1)B) (B = ``block``), or at kB
    when a line spans that whole range, moved to the next UTF-8 character."""
    size = f.stat().st_size
    n = n_blocks(size, block)
    line = 1
    with f.open("rb") as fh:
        buf, off, start = b"", 0, 0  # buf holds the file's bytes [off, off + len(buf))
        for k in range(n):
            last = k == n - 1
            lo = (k + 1) * block  # where block k + 1 may start
            want = size if last else min(size, lo + block)
            while off + len(buf) < want:
                chunk = fh.read(want - off - len(buf))
                if not chunk:
                    break
                buf += chunk
            end = off + len(buf) if last else off + _next_start(buf, lo - off, want - off)
            data = buf[start - off : end - off]
            err = _not_text(f, data, start, line)
            if err is not None:
                raise err
            line += data.count(b"\n")
            yield Block(k, data)
            buf, off, start = buf[end - off :], end, end


def _next_start(buf: bytes, lo: int, hi: int) -> int:
    hi = min(hi, len(buf))
    if lo >= hi:
        return hi
    nl = buf.find(b"\n", lo - 1, hi - 1) if lo > 0 else -1
    if nl >= 0:
        return nl + 1
    while lo < hi and 0x80 <= buf[lo] < 0xC0:  # not inside a multi-byte character
        lo += 1
    return lo


def _load_datasets(path: Path) -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            f"{path} is a `datasets` folder; install the datasets package to read it"
        ) from e
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return ds


def records(f: Path, name: str, cfg: TrainConfig) -> Iterator[tuple[str, Any]]:
    """(document name, record) of a JSONL file or ``datasets`` folder: the text for
    pre-training, the record for SFT; malformed records are named with file and line."""
    if f.is_dir():
        for i, rec in enumerate(_load_datasets(f)):
            yield f"{name}:{i}", record(rec, cfg, f"{f} row {i}")
        return
    for i, line in enumerate(text_lines(f)):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{f}:{i + 1} is not valid JSON ({e.msg})") from e
        yield f"{name}:{i}", record(rec, cfg, f"{f}:{i + 1}")


def record(rec: Any, cfg: TrainConfig, where: str) -> Any:
    if cfg.task == "sft":
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


_ROLES = frozenset({"system", "user", "assistant"})  # the roles an SFT message may have


def messages_of(rec: Any, where: str) -> list[dict[str, str]]:
    """An SFT record's messages (``{"prompt", "response"}`` as a user and an assistant message),
    checked: a malformed record raises a ``ConfigError`` naming ``where``."""
    if isinstance(rec, dict) and "messages" in rec:
        msgs = rec["messages"]
    elif isinstance(rec, dict) and "prompt" in rec and "response" in rec:
        for key in ("prompt", "response"):
            if not isinstance(rec[key], str):
                what = "null" if rec[key] is None else f"a {type(rec[key]).__name__}"
                raise ConfigError(f"{where}: '{key}' is {what}, not a string")
        msgs = [
            {"role": "user", "content": rec["prompt"]},
            {"role": "assistant", "content": rec["response"]},
        ]
    else:
        raise ConfigError(
            f"{where}: an SFT record needs 'prompt' and 'response' fields or a 'messages' list"
        )
    if not isinstance(msgs, list) or not msgs:
        raise ConfigError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or "content" not in m:
            raise ConfigError(
                f"{where}: each message needs a role (system/user/assistant) and content"
            )
        if not isinstance(m["content"], str):
            what = "null" if m["content"] is None else f"a {type(m['content']).__name__}"
            raise ConfigError(f"{where}: the content of message {i + 1} is {what}, not a string")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ConfigError(f"{where}: the record has no assistant message to train on")
    return msgs


# --- pieces for the tokenizer ----------------------------------------------------------------


def _printable(b: int) -> bool:
    return 0x21 <= b <= 0x7E  # ASCII, not a space: never part of a multi-byte character


def cut(data: bytes | bytearray, limit: int) -> int:
    """Where to end a piece of at most ``limit`` bytes of ``data`` (longer than ``limit``).

    Preferably after a line break between two printable ASCII characters (``x\\n|y``), else
    before a single space between two (``x| y``), in the second half of the piece. Byte-level BPE
    pre-tokenizers (GPT-2's and Llama 3's patterns) split there anyway: the text before is
    followed by whitespace that ends its last pre-token, and the text after starts a new one,
    so encoding the two pieces gives the tokens of the whole. Only text without such a place
    in ``limit / 2`` bytes (base64, minified code) is cut elsewhere, at a character boundary.
    """
    lo = limit // 2
    i = data.rfind(b"\n", lo, limit)
    while i > lo:
        if _printable(data[i - 1]) and _printable(data[i + 1]):
            return i + 1
        i = data.rfind(b"\n", lo, i)
    i = data.rfind(b" ", lo, limit)
    while i > lo:
        if _printable(data[i - 1]) and _printable(data[i + 1]):
            return i
        i = data.rfind(b" ", lo, i)
    i = limit
    while 0x80 <= data[i] < 0xC0:
        i -= 1
    return i


def pieces(data: bytes, limit: int = PIECE) -> list[bytes]:
    """``data`` cut into pieces of at most ``limit`` bytes (see ``cut``)."""
    out = []
    while len(data) > limit:
        c = cut(data, limit)
        out.append(data[:c])
        data = data[c:]
    out.append(data)
    return out


@dataclass
class Piece:
    split: str  # "train" or "val"
    data: bytes  # UTF-8 text, at most PIECE bytes
    end: bool  # the last piece of its document: an end-of-text token follows


def _blank(data: bytes | bytearray) -> bool:
    return not data.strip() and not data.decode("utf-8").strip()


def text_pieces(
    files: list[Path],
    names: list[str],
    cfg: TrainConfig,
    route: Callable[[str], str | None],
    progress: Callable[[int], None] = lambda n: None,
    blank: bool = False,
    block: int | None = None,
) -> Iterator[Piece]:
    """The pre-training text of the corpus in order, as pieces of at most ``PIECE`` bytes.
    ``route(name)`` gives each document's split, or None to leave it out. Blank documents
    (whitespace only) are left out unless ``blank`` (they add no tokens, and no end-of-text
    token, but the BPE counted their whitespace). ``progress(n)`` is told of every n bytes
    read. Text files are read in blocks of ``block`` bytes; by default the block size of the
    ``SplitPlan`` whose ``split_of`` is ``route``, else ``SPLIT_BLOCK``."""
    if block is None:
        plan = getattr(route, "__self__", None)
        block = plan.block if isinstance(plan, SplitPlan) else SPLIT_BLOCK
    for f, name in zip(files, names):
        if f.is_dir() or f.suffix == ".jsonl":
            yield from _record_pieces(f, name, cfg, route, progress, blank)
        else:
            yield from _file_pieces(f, name, route, progress, blank, block)


def _record_pieces(
    f: Path,
    name: str,
    cfg: TrainConfig,
    route: Callable[[str], str | None],
    progress: Callable[[int], None],
    blank: bool,
) -> Iterator[Piece]:
    told, done, size = 0, 0, source_bytes(f)
    for doc, text in records(f, name, cfg):
        done += len(text)  # characters, not bytes: close enough for a progress bar
        if done - told > 1 << 20 and done < size:
            progress(done - told)
            told = done
        split = route(doc)
        if split is None or (not blank and not text.strip()):
            continue
        parts = pieces(text.encode("utf-8"))
        for j, p in enumerate(parts):
            yield Piece(split, p, j == len(parts) - 1)
    progress(size - told)


def _file_pieces(
    f: Path,
    name: str,
    route: Callable[[str], str | None],
    progress: Callable[[int], None],
    blank: bool,
    block_bytes: int,
) -> Iterator[Piece]:
    """A text file's runs of consecutive blocks in one split, each one document, in pieces."""
    split: str | None = None  # of the current run
    run = bytearray()  # its text not yet given out
    has_text = blank  # whether the run has given out a piece: then it is not blank

    def end_of_run() -> Iterator[Piece]:
        if split is not None and (has_text or not _blank(run)):
            yield Piece(split, bytes(run), True)

    for block in text_blocks(f, block_bytes):
        progress(len(block.data))
        block_split = route(block_name(name, block.k))
        if block_split != split:
            yield from end_of_run()
            split, run, has_text = block_split, bytearray(), blank
        if split is None:
            continue
        run += block.data
        while len(run) > PIECE:
            c = cut(run, PIECE)
            head = bytes(run[:c])
            del run[:c]
            if has_text or not _blank(head):  # blank text before any text is left out
                has_text = True
                yield Piece(split, head, False)
    yield from end_of_run()
