"""Writes a synthetic corpus of a given size for the data-preparation benchmark (deterministic).

    python benchmarks/data/make_corpus.py /tmp/corpus-1g 1024     # MB

Its parts, by share of the bytes:
- 75% prose: words drawn from a Zipf law over a 4M-word vocabulary of random letter strings, so
  that a larger corpus has more distinct words (as real text does: Heaps' law), with punctuation,
  line breaks and paragraphs; files of at most 64 MB;
- 6.25% code: lines of the Python standard library's sources, shuffled;
- 12.5% JSONL: {"text": paragraph} records;
- 6.25% one single line (no line break at all), the shape that crashed the tokenizer before.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

MB = 1 << 20
VOCAB = 4_000_000
SEPS = [" "] * 80 + [", "] * 6 + [". "] * 5 + ["\n"] * 8 + [".\n\n"]


def _vocab(rng: np.random.Generator) -> np.ndarray:
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    lengths = rng.integers(2, 11, size=VOCAB)
    flat = letters[rng.integers(0, 26, size=int(lengths.sum()))].tobytes().decode()
    ends = np.cumsum(lengths)
    words = [flat[e - n : e] for e, n in zip(ends.tolist(), lengths.tolist())]
    common = "the of and to a in is that for it as was with be by on not he".split()
    words[: len(common)] = common
    return np.asarray(words, dtype=object)


def _zipf_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    # inverse CDF of a Zipf law with exponent ~1.07 over VOCAB ranks (continuous approximation)
    s = 1.07
    u = rng.random(n)
    hi = VOCAB ** (1 - s)
    ranks = (1 + u * (hi - 1)) ** (1 / (1 - s))
    return np.minimum(ranks.astype(np.int64) - 1, VOCAB - 1)


def prose(rng: np.random.Generator, vocab: np.ndarray, nbytes: int, newlines: bool = True) -> str:
    seps = np.asarray(SEPS if newlines else [s for s in SEPS if "\n" not in s], dtype=object)
    out, size = [], 0
    while size < nbytes:
        n = 1 << 20
        words = vocab[_zipf_ids(rng, n)].tolist()
        sep = seps[rng.integers(0, len(seps), size=n)].tolist()
        chunk = "".join([w + s for w, s in zip(words, sep)])
        out.append(chunk)
        size += len(chunk)
    return "".join(out)[:nbytes]


def code(rng: np.random.Generator, nbytes: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for f in sorted(root.glob("*.py")):
        lines += f.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    arr = np.asarray(lines, dtype=object)
    out, size = [], 0
    while size < nbytes:
        chunk = "".join(arr[rng.permutation(len(arr))].tolist())
        out.append(chunk)
        size += len(chunk)
    return "".join(out)[:nbytes]


def main(folder: str, total_mb: int) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    vocab = _vocab(rng)
    total = total_mb * MB
    prose_left = total * 75 // 100
    i = 0
    while prose_left > 0:
        n = min(64 * MB, prose_left)
        (out / f"prose_{i:02d}.txt").write_text(prose(rng, vocab, n), encoding="utf-8")
        prose_left -= n
        i += 1
    (out / "code.py").write_text(code(rng, total * 625 // 10000), encoding="utf-8")
    text = prose(rng, vocab, total * 125 // 1000)
    with (out / "records.jsonl").open("w", encoding="utf-8") as fh:
        start = 0
        while start < len(text):
            end = start + int(rng.integers(200, 8000))
            fh.write(json.dumps({"text": text[start:end]}) + "\n")
            start = end
    (out / "one_line.txt").write_text(
        prose(rng, vocab, total * 625 // 10000, newlines=False), encoding="utf-8"
    )
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{out}: {len(list(out.iterdir()))} files, {size / MB:.1f} MB")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
