"""What a corpus is, cheaply: the identity of a prepared dataset and whether its sources changed.

Every launch fingerprints its corpus, so this must stay cheap for corpora of many gigabytes:
hashing everything costs ~0.7 s per GB of CPU at SHA-256's 1.4 GB/s on the development machine
(plus the read, from disk or a network file system), every launch. Instead a file's *stamp* is
its absolute path, size, modification time and a SHA-256 of sampled blocks (the whole file up
to ``_sample_cap`` bytes: all of any file under 1 MiB; 16 evenly spread blocks including the
first and the last otherwise; at most 256 MiB read for the whole corpus). Preparation, which
reads every byte anyway, also records each file's full SHA-256, so that a file whose stamp
changed in a way the sample cannot settle (modified, same size, same sampled bytes) is settled
by hashing that one file again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from layershard.train.config import TrainConfig

_WHOLE = 1 << 20  # files up to this size are hashed whole
_BLOCKS = 16
_BUDGET = 256 << 20  # sampled bytes for the whole corpus


@dataclass
class Stamp:
    path: str  # absolute
    size: int
    mtime_ns: int
    cap: int  # bytes sampled: the whole file when size <= cap
    sample: str  # SHA-256 of the sampled bytes
    sha256: str | None = None  # of the whole file; recorded by preparation


def leaves(files: list[Path]) -> list[Path]:
    """The files the corpus reads: each file, and every file inside a ``datasets`` folder."""
    out: list[Path] = []
    for f in files:
        out += sorted(s for s in f.rglob("*") if s.is_file()) if f.is_dir() else [f]
    return out


def _sample_cap(n_files: int) -> int:
    return max(4096 * _BLOCKS, min(_WHOLE, _BUDGET // max(1, n_files)))


def _sample(path: Path, size: int, cap: int) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        if size <= cap:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        else:
            block = cap // _BLOCKS
            for i in range(_BLOCKS):
                fh.seek((size - block) * i // (_BLOCKS - 1))
                h.update(fh.read(block))
    return h.hexdigest()


def stamp(path: Path, cap: int) -> Stamp:
    st = path.stat()
    return Stamp(str(path), st.st_size, st.st_mtime_ns, cap, _sample(path, st.st_size, cap))


def stamps(files: list[Path]) -> list[Stamp]:
    paths = leaves(files)
    cap = _sample_cap(len(paths))
    return [stamp(p, cap) for p in paths]


def full_hash(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def corpus_key(files: list[Path], names: list[str], cfg: TrainConfig, version: int) -> str:
    """The identity of a prepared corpus: the stamps of its files, their names in the split and
    the settings that change how it is read and split. Touching a file changes it."""
    h = hashlib.sha256()
    settings = [version, cfg.task, cfg.text_key, cfg.val_fraction, bool(cfg.data), names]
    h.update(json.dumps(settings).encode())
    for s in stamps(files):
        h.update(json.dumps([s.path, s.size, s.mtime_ns, s.sample]).encode())
    return h.hexdigest()


def record(files: list[Path]) -> list[dict[str, Any]]:
    """Stamps with full hashes, as a prepared dataset records its sources."""
    out = []
    for s in stamps(files):
        s.sha256 = full_hash(Path(s.path))
        out.append(asdict(s))
    return out


def corpus_change(recorded: list[dict[str, Any]], files: list[Path]) -> str | None:
    """None if ``files`` are the sources a dataset was prepared from (``recorded``, its
    manifest's ``"sources"``), else one line saying what changed. A file whose modification
    time moved but whose size and sampled bytes did not is hashed whole and compared with the
    recorded hash: a touched file is unchanged, an edited one is not."""
    was = {r["path"]: r for r in recorded}
    now = leaves(files)
    now_set = {str(p) for p in now}
    gone = [p for p in was if p not in now_set]
    new = [str(p) for p in now if str(p) not in was]
    if gone and new:
        return (
            f"{gone[0]} is no longer in the corpus, which now has {new[0]}"
            + (f" and {len(new) - 1} other new files" if len(new) > 1 else "")
            + " (a relative --data path that resolves elsewhere from this folder?)"
        )
    if gone:
        return f"{gone[0]} is gone" + (f" (and {len(gone) - 1} more)" if len(gone) > 1 else "")
    if new:
        return f"{new[0]} is new" + (f" (and {len(new) - 1} more)" if len(new) > 1 else "")
    for p in now:
        r = was[str(p)]
        st = p.stat()
        if st.st_size != r["size"]:
            return f"{p} changed (size {r['size']} -> {st.st_size})"
        if _sample(p, st.st_size, r["cap"]) != r["sample"]:
            return f"{p} changed (same size {st.st_size}, different content)"
        if st.st_mtime_ns != r["mtime_ns"] and r.get("sha256") and full_hash(p) != r["sha256"]:
            return f"{p} changed (modified, same size {st.st_size}, different content)"
    if [str(p) for p in now] != list(was):
        return "the corpus files are the same but in another order"
    return None
