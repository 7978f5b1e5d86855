"""The prepared-corpus cache under concurrency and crashes, and the corpus fingerprint:
two launches at once prepare once, a half-written entry is never used, and a changed corpus is
named in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from layershard.train.config import resolve
from layershard.train.data import fingerprint
from layershard.train.data.batches import TokenSplit
from layershard.train.data.cache import exclusive
from layershard.train.data.fingerprint import corpus_change
from layershard.train.data.prepare import (
    bpe_texts,
    corpus_hash,
    entry_folder,
    load_entry,
    lock_path,
    prepare_splits,
)
from layershard.train.data.sources import find_files
from layershard.train.data.tokenizer import train_or_load_bpe

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A small corpus, its config and a trained tokenizer saved to tok.json."""
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LAYERSHARD_PREPARE_WORKERS", raising=False)
    folder = tmp_path / "corpus"
    folder.mkdir()
    for f in sorted((Path(SRC) / "layershard" / "train").glob("*.py"))[:8]:
        (folder / f.name).write_text(f.read_text())
    cfg = resolve({"data": [str(folder)], "val_fraction": 0.2, "vocab_size": 300})
    files = find_files(cfg)
    tok, _ = train_or_load_bpe(lambda: bpe_texts(files, cfg), corpus_hash(files, cfg), 300)
    tok.save(tmp_path / "tok.json")
    return cfg, files, tok


# A launch's data preparation in a process of its own (as on another node); ``SLOW`` makes every
# tokenizer call take 0.3 s so that the test can kill it half-way.
CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from layershard.train.data import prepare
    from layershard.train.config import resolve
    from layershard.train.data.sources import find_files
    from layershard.train.data.tokenizer import load_tokenizer
    if os.environ.get("SLOW"):
        prepare.TASK_BYTES = 8192
        fast = prepare.LocalEncoder.map
        def slow(self, tasks):
            for out in fast(self, tasks):
                time.sleep(0.3)
                yield out
        prepare.LocalEncoder.map = slow
    cfg = resolve(json.loads(sys.argv[1]))
    files = find_files(cfg)
    m = prepare.prepare_splits(files, cfg, load_tokenizer(sys.argv[2]), prepare.corpus_hash(files, cfg))
    print(json.dumps({"pid": os.getpid(), "prepared_by": m["prepared_by"], "cache": m["cache"]}))
    """
)


def _child(cfg, tmp_path, **env) -> subprocess.Popen:
    args = json.dumps({"data": cfg.data, "val_fraction": cfg.val_fraction, "vocab_size": 300})
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, args, str(tmp_path / "tok.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC, **env},
    )


def _until(cond, what: str, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_two_launches_at_once_prepare_the_corpus_once(corpus, tmp_path):
    cfg, files, tok = corpus
    entry = entry_folder(cfg, tok, corpus_hash(files, cfg))
    # Hold the entry's lock while both start, so that both find it busy and must wait; released,
    # one of them takes it and prepares, the other waits for that one and reuses its result.
    with exclusive(lock_path(entry), "holding the lock for the test"):
        procs = [_child(cfg, tmp_path) for _ in range(2)]
        waiting = [
            f"pid {os.getpid()} on" in (p.stderr.readline() if p.stderr else "") for p in procs
        ]
        assert waiting == [True, True]  # each said it waits, and for whom
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    preparers = {r["prepared_by"].split(" on ")[0] for r in results}
    assert len(preparers) == 1  # both use the one entry
    assert preparers <= {f"pid {r['pid']}" for r in results}  # which one of them prepared
    assert sum("tokenized" in o for o, _ in outs) == 1  # and only that one tokenized
    assert {r["cache"] for r in results} == {str(entry)}
    assert not list(entry.parent.glob(".*tmp*"))  # no scratch folder left behind


def _tokens(m) -> list[list[int]]:
    return [TokenSplit.from_dict(m[s]).open()[0].tolist() for s in ("train", "val")]


def test_a_half_written_entry_is_never_used(corpus, tmp_path, monkeypatch):
    cfg, files, tok = corpus
    chash = corpus_hash(files, cfg)
    entry = entry_folder(cfg, tok, chash)
    # killed while tokenizing: its scratch folder is left, the entry does not exist
    proc = _child(cfg, tmp_path, SLOW="1")

    def started() -> bool:
        return any(f.stat().st_size > 0 for f in entry.parent.glob(".*tmp*/train.bin"))

    _until(started, "the child to write tokens")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not entry.exists() and list(entry.parent.glob(".*tmp*"))
    m = prepare_splits(files, cfg, tok, chash)  # prepares it afresh, removing the scratch
    assert not list(entry.parent.glob(".*tmp*"))
    assert m["prepared_by"].startswith(f"pid {os.getpid()} ")
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "clean"))
    clean = prepare_splits(files, cfg, tok, chash)
    assert _tokens(m) == _tokens(clean) and m["train"]["n_tokens"] > 1000
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "cache"))

    # an entry whose token file is short (copied in part, disk trouble), or one in the layout
    # of the earlier code (no format, absolute paths): not used, prepared again
    train = Path(m["train"]["tokens_path"])
    with train.open("r+b") as fh:
        fh.truncate(train.stat().st_size - 2)
    assert load_entry(entry) is None
    again = prepare_splits(files, cfg, tok, chash)
    assert _tokens(again) == _tokens(clean) and again["prepared_by"] == m["prepared_by"]
    manifest = entry / "manifest.json"
    old = json.loads(manifest.read_text())
    old.pop("format")
    manifest.write_text(json.dumps(old))
    assert load_entry(entry) is None
    assert _tokens(prepare_splits(files, cfg, tok, chash)) == _tokens(clean)


def test_the_manifest_records_its_sources(corpus, tmp_path, monkeypatch):
    cfg, files, tok = corpus
    monkeypatch.chdir(tmp_path)
    rel = resolve({"data": ["corpus"], "val_fraction": 0.2, "vocab_size": 300})
    rel_files = find_files(rel)
    assert rel_files == files  # a relative --data path is made absolute
    assert corpus_hash(rel_files, rel) == corpus_hash(files, cfg)
    m = prepare_splits(files, cfg, tok, corpus_hash(files, cfg))
    assert [s["path"] for s in m["sources"]] == [str(f) for f in files]
    assert all(os.path.isabs(s["path"]) for s in m["sources"])
    for s, f in zip(m["sources"], files):
        assert s["size"] == f.stat().st_size and s["sha256"] == fingerprint.full_hash(f)
    assert corpus_change(m["sources"], files) is None


def test_corpus_change_names_what_changed(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    a, b = folder / "a.txt", folder / "b.txt"
    a.write_text("hello\n" * 100)
    rng = np.random.default_rng(0)
    big = rng.integers(97, 123, size=3 << 20, dtype=np.uint8)  # 3 MiB: sampled, not whole
    b.write_bytes(big.tobytes())
    cfg = resolve({"data": [str(folder)]})
    files = find_files(cfg)
    key = corpus_hash(files, cfg)
    rec = fingerprint.record(files)
    assert corpus_change(rec, files) is None and corpus_hash(files, cfg) == key

    # touched: the modification time moved, the content did not (settled by the full hash)
    os.utime(b, ns=(b.stat().st_atime_ns, b.stat().st_mtime_ns + 5_000_000_000))
    assert corpus_change(rec, files) is None
    assert corpus_hash(files, cfg) != key  # the cache is keyed conservatively: prepared again

    # an edit of the same size in bytes that the sample does not read: the full hash sees it
    edited = big.copy()
    edited[len(big) // 2 + 12345] ^= 1
    b.write_bytes(edited.tobytes())
    assert corpus_change(rec, files) == (
        f"{b} changed (modified, same size {3 << 20}, different content)"
    )
    # an edit in sampled bytes: seen without reading the whole file
    edited = big.copy()
    edited[5] ^= 1
    b.write_bytes(edited.tobytes())
    assert corpus_change(rec, files) == f"{b} changed (same size {3 << 20}, different content)"
    b.write_bytes(big.tobytes())
    assert corpus_change(rec, files) is None

    a.write_text("hello\n" * 101)
    assert corpus_change(rec, files) == f"{a} changed (size 600 -> 606)"
    a.write_text("hello\n" * 100)
    c = folder / "c.txt"
    c.write_text("new\n")
    assert corpus_change(rec, find_files(cfg)) == f"{c} is new"
    c.unlink()
    a.unlink()
    assert corpus_change(rec, find_files(cfg)) == f"{a} is gone"
    a.write_text("hello\n" * 100)

    # the same relative --data path run from another folder resolves to another corpus
    other = tmp_path / "elsewhere" / "data"
    other.mkdir(parents=True)
    (other / "a.txt").write_text("hello\n" * 100)
    line = corpus_change(rec, find_files(resolve({"data": [str(other)]})))
    assert line is not None and line.startswith(f"{a} is no longer in the corpus, which now has")


def test_a_file_rewritten_while_it_is_tokenized_is_never_cached(tmp_path, monkeypatch):
    """Issue 35: a corpus file rewritten in place while it was being tokenized gave exit 0 and
    a cache entry that recorded the old file's size and hash over tokens of neither version.
    Preparation now compares each file's size and full hash after reading with what it
    recorded before, and refuses (one line naming the file) without caching anything."""
    from layershard.train.config import ConfigError
    from layershard.train.data import sources

    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LAYERSHARD_PREPARE_WORKERS", raising=False)
    f = tmp_path / "corpus.txt"
    old = "one two three four five six seven\n" * 40_000  # ~1.4 MB: several blocks
    f.write_text(old)
    cfg = resolve({"data": [str(f)], "val_fraction": 0.05, "vocab_size": 300})
    files = find_files(cfg)
    chash = corpus_hash(files, cfg)
    tok, _ = train_or_load_bpe(lambda: bpe_texts(files, cfg), chash, 300)
    read = sources.text_blocks

    def rewritten_after_the_first_block(path, *args):
        for k, block in enumerate(read(path, *args)):
            yield block
            if k == 0:  # another program rewrites the file in place, at the same size
                with open(path, "r+b") as fh:
                    fh.write(old.replace("two", "TWO").encode())

    monkeypatch.setattr(sources, "text_blocks", rewritten_after_the_first_block)
    with pytest.raises(ConfigError) as e:
        prepare_splits(files, cfg, tok, chash)
    assert str(e.value).startswith(f"{f} changed while it was being tokenized"), e.value
    assert "\n" not in str(e.value)
    entry = entry_folder(cfg, tok, chash)
    assert not entry.exists() and not list(entry.parent.glob(".*tmp*"))


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_is_one_line_naming_the_folder_and_the_space(tmp_path, monkeypatch, capsys):
    """Issue 35: a full disk during preparation ended in numpy's traceback ("OSError: N
    requested and 0 written"), which never says the disk is full. The token files are written
    to /dev/full here (ENOSPC from the kernel, numpy's own error): `layershard train` exits 2
    with one line naming the cache folder and the space needed, and leaves no scratch folder."""
    from _train import train_main

    from layershard.train.data import prepare

    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LAYERSHARD_PREPARE_WORKERS", raising=False)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("def f(x):\n    return x * 2\n" * 2000)
    real = prepare._Writer.__init__

    def on_a_full_disk(self, folder, split, dtype, with_mask):
        real(self, folder, split, dtype, with_mask)
        self.fh.close()
        self.fh = open("/dev/full", "wb")  # noqa: SIM115 - closed by the writer

    monkeypatch.setattr(prepare._Writer, "__init__", on_a_full_disk)
    run = tmp_path / "run"
    argv = ["--data", str(tmp_path / "data"), "--vocab-size", "300", "--run-dir", str(run),
            "--nproc-per-node", "1", "--seq-len", "16", "--micro-batch", "1"]  # fmt: skip
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    tokens = tmp_path / "cache" / "tokens"
    assert err.count("\n") == 0, err
    assert err.startswith(f"layershard train: error: the disk holding {tokens} is full ("), err
    assert "the tokenized corpus needs up to" in err and "LAYERSHARD_CACHE" in err, err
    assert not run.exists()
    assert not [p for p in tokens.iterdir() if not p.name.endswith(".lock")]
