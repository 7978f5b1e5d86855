"""Peak memory and throughput of data preparation: `layershard train --dry-run --data CORPUS`
(fingerprint, BPE on its sample, tokenization into the cache), on synthetic corpora.

    python benchmarks/data/measure.py 100 1024            # MB; corpora under /tmp, deleted after
    python benchmarks/data/measure.py --src /tmp/old/src --file-mb 16   # another tree, one file

Each preparation runs in a fresh cache as a child process. Memory is measured two ways: the
largest max RSS of any one process of the tree (`getrusage(RUSAGE_CHILDREN)`, what
`/usr/bin/time -v` reports), and the peak of the whole tree's summed PSS, sampled every 0.1 s
from /proc (the launcher and its tokenizer processes together; PSS counts shared pages once).
Linux only. Prints one JSON line per run and a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


# Runs the command and reports getrusage(RUSAGE_CHILDREN).ru_maxrss: the largest max RSS of any
# one of its processes (KiB). A wrapper per run, so that no earlier child counts.
WRAP = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
    "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
    "print('MAXRSS_KIB', u.ru_maxrss, 'CPU_S', u.ru_utime + u.ru_stime); sys.exit(rc)"
)


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d))
    return out


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.stop = pid, threading.Event()
        self.peak_pss = self.peak_rss = self.peak_procs = 0

    def run(self) -> None:
        while not self.stop.wait(0.1):
            pids = _tree(self.pid)
            self.peak_pss = max(self.peak_pss, sum(_kib(p, "Pss") for p in pids))
            self.peak_rss = max(self.peak_rss, sum(_kib(p, "Rss") for p in pids))
            self.peak_procs = max(self.peak_procs, len(pids))


def run(data: list[str], src: Path, label: str, vocab: int, env_extra: dict[str, str]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ls-prep-", dir="/tmp"))
    env = {**os.environ, "PYTHONPATH": str(src), "LAYERSHARD_CACHE": str(work / "cache"),
           **env_extra}  # fmt: skip
    cmd = [sys.executable, "-c", WRAP, sys.executable, "-m", "layershard",
           "train", "--dry-run", "--vocab-size", str(vocab), "--run-dir", str(work / "run"),
           "--data", *data]  # fmt: skip
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)  # fmt: skip
    sampler = TreeSampler(proc.pid)
    sampler.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    maxrss = re.search(r"MAXRSS_KIB (\d+) CPU_S ([\d.]+)", out)
    corpus = sum(
        f.stat().st_size
        for d in data
        for f in (Path(d).rglob("*") if Path(d).is_dir() else [Path(d)])
        if f.is_file()
    )
    bpe = re.search(r"trained a \d+-token BPE on the corpus in ([\d.]+)s", out)
    tok = re.search(r"tokenized ([\d.]+) MB in ([\d.]+) s \(([\d.]+) MB/s, ([^)]*)\)", out)
    res = {
        "label": label,
        "corpus_mb": round(corpus / 1e6, 1),
        "exit": proc.returncode,
        "wall_s": round(wall, 1),
        "bpe_s": float(bpe.group(1)) if bpe else None,
        "tokenize_s": float(tok.group(2)) if tok else None,
        "tokenize_mb_s": float(tok.group(3)) if tok else None,
        "workers": tok.group(4) if tok else None,
        "overall_mb_s": round(corpus / 1e6 / wall, 2),
        # CPU seconds of all its processes: less sensitive to other jobs than the wall time
        "cpu_s": round(float(maxrss.group(2)), 1) if maxrss else None,
        "max_rss_one_process_mb": round(int(maxrss.group(1)) / 1024, 1) if maxrss else None,
        "peak_tree_pss_mb": round(sampler.peak_pss / 1024, 1),
        "peak_tree_rss_mb": round(sampler.peak_rss / 1024, 1),
        "peak_processes": sampler.peak_procs,
        "load_before": [round(x, 2) for x in load0],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    if proc.returncode != 0:
        res["output_tail"] = out[-2000:]
    else:  # a second launch on the same corpus: fingerprint, and the cache entry reused
        cmd[cmd.index(str(work / "run"))] = str(work / "run2")
        t0 = time.perf_counter()
        again = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        res["cached_launch_s"] = round(time.perf_counter() - t0, 1)
        res["cached_launch_tokenized_again"] = "tokenized" in again.stdout
    shutil.rmtree(work, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="*", type=int, help="synthetic corpus sizes in MB")
    ap.add_argument("--src", default=str(ROOT / "src"), help="the layershard tree to measure")
    ap.add_argument("--file-mb", type=int, help="also: one prose file of this many MB")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--workers", help="LAYERSHARD_PREPARE_WORKERS for the runs")
    ap.add_argument("--keep", action="store_true", help="keep the generated corpora")
    args = ap.parse_args()
    print(subprocess.run(["df", "-h", "/tmp"], capture_output=True, text=True).stdout, flush=True)
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S %z')}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()}, src {args.src}", flush=True)  # fmt: skip
    env = {"LAYERSHARD_PREPARE_WORKERS": args.workers} if args.workers else {}
    made = []
    results = []
    for mb in args.sizes:
        folder = Path(f"/tmp/ls-corpus-{mb}mb")
        if not folder.exists():
            made.append(folder)
            subprocess.run([sys.executable, str(HERE / "make_corpus.py"), str(folder), str(mb)],
                           check=True)  # fmt: skip
        results.append(run([str(folder)], Path(args.src), f"{mb} MB corpus", args.vocab, env))
        print(json.dumps(results[-1]), flush=True)
    if args.file_mb:
        folder = Path(f"/tmp/ls-corpus-{args.file_mb}mb-file")
        if not folder.exists():
            made.append(folder)
            subprocess.run([sys.executable, str(HERE / "make_corpus.py"), str(folder),
                            str(args.file_mb * 4 // 3 + 1)], check=True)  # fmt: skip
        one = folder / "one_file.txt"
        with open(folder / "prose_00.txt", "rb") as fh:
            one.write_bytes(fh.read(args.file_mb << 20))
        results.append(run([str(one)], Path(args.src), f"one {args.file_mb} MB file",
                           args.vocab, env))  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    if not args.keep:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
    print("\n| run | corpus MB | wall s | CPU s | BPE s | tokenize s | tokenize MB/s | max RSS one"
          " process MB | peak PSS all processes MB | cached launch s | load before -> after |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['label']} | {r['corpus_mb']} | {r['wall_s']} | {r['cpu_s']} | {r['bpe_s']} | "
              f"{r['tokenize_s']} | {r['tokenize_mb_s']} ({r['workers']}) | "
              f"{r['max_rss_one_process_mb']} | {r['peak_tree_pss_mb']} | {r.get('cached_launch_s')} | "
              f"{r['load_before'][0]} -> {r['load_after'][0]} |")  # fmt: skip


if __name__ == "__main__":
    main()
