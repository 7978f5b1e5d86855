"""The code blocks of the user docs (README.md and docs/**/*.md), parsed and run.

Every fenced block has a language, and the language decides what happens to it:

- ``python``: run, in one process, or on N local gloo ranks under torchrun (``ranks N``);
- ``bash``/``sh``/``shell``: run by ``bash -e -o pipefail`` (several commands run in order);
- ``yaml``/``json``/``jsonl``/``toml``: data; written to a file a later block uses (``file``);
- ``text``: output or a diagram; never run.

A block without a language, with another one, or a data block that no block uses is an error,
so no block can drop out of the tests unnoticed. Each page runs in a fresh folder of its own
(``examples/`` linked into it), its blocks in page order, so a later block sees what an earlier
one wrote (a checkpoint, a config file).

A block's directives are HTML comments right before it (blank lines between are fine; they do
not show on GitHub or on the site), one per comment::

    <!-- docs-test: skip REASON -->       not run, and why (GPU-only, other machines, pip)
    <!-- docs-test: same-as PAGE -->      not run here: a block of PAGE holds the same lines
    <!-- docs-test: ranks N -->           python: on N gloo ranks (torchrun --standalone)
    <!-- docs-test: continue -->          python: the previous python block's program goes on
    <!-- docs-test: prelude
    CODE -->                              python: hidden CODE first (names the block uses)
    <!-- docs-test: env KEY=VALUE ... --> environment of the run
    <!-- docs-test: sub OLD => NEW -->    run with OLD replaced by NEW (OLD must occur; in NEW,
                                          {free_port} is a free TCP port)
    <!-- docs-test: append CMD ARGS -->   shell: ARGS added to every command that starts with
                                          CMD (quote a CMD of several words: "layershard train")
    <!-- docs-test: file PATH -->         write the block to PATH in the page's folder
    <!-- docs-test: expect REGEX -->      the run's output (stdout and stderr) matches REGEX
    <!-- docs-test: exit N -->            the run exits with N (default 0)
    <!-- docs-test: timeout SECONDS -->   (default 240)
    <!-- docs-test: slow -->              the page's test is in the slow tier (pytest -m slow)
    <!-- docs-test: output -->            (a text block) output the run before it prints: every
                                          line of it but "..." occurs in that run's output

Run pages by hand, with their outputs (``-v``): ``python tests/docs_support/blocks.py -v
docs/checkpoint.md [...]`` (``DOCS_TEST_CACHE=DIR`` keeps the caches between calls).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
DATA = {"yaml", "yml", "json", "jsonl", "toml"}
TEXT = {"text"}
KEYS = {
    "skip",
    "same-as",
    "ranks",
    "continue",
    "prelude",
    "env",
    "sub",
    "append",
    "file",
    "expect",
    "exit",
    "timeout",
    "slow",
    "output",
}
DEFAULT_TIMEOUT_S = 240.0

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[^\s`]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)(?P<end>-->)?\s*$")


class DocsError(Exception):
    """A page whose blocks or directives break the rules above."""


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    directives: list[tuple[str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"

    def values(self, key: str) -> list[str]:
        return [v for k, v in self.directives if k == key]

    def has(self, key: str) -> bool:
        return any(k == key for k, _ in self.directives)


@dataclass
class Unit:
    """One thing the test does: write a file, or run a program or a shell script."""

    kind: str  # "file", "python" or "shell"
    blocks: list[Block]
    code: str
    path: str = ""  # kind "file": where it is written
    ranks: int = 1
    env: dict[str, str] = field(default_factory=dict)
    expect: list[str] = field(default_factory=list)
    shown: list[str] = field(default_factory=list)  # lines of output blocks that must occur
    exit: int = 0
    timeout: float = DEFAULT_TIMEOUT_S

    @property
    def where(self) -> str:
        return self.blocks[0].where


@dataclass
class Page:
    path: Path
    blocks: list[Block]
    units: list[Unit]
    skipped: list[tuple[Block, str]]
    same_as: list[tuple[Block, str]]
    slow: bool

    @property
    def name(self) -> str:
        return _rel(self.path)


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def pages() -> list[Path]:
    """The user docs: README.md and every page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def read_blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path`` with the directives written right before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: list[tuple[str, str]] = []
    pending_line = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line)
        if marker:
            body = marker.group("body")
            start = i
            if not marker.group("end"):  # a comment over several lines (a prelude)
                parts = [body]
                i += 1
                while i < len(lines) and "-->" not in lines[i]:
                    parts.append(lines[i])
                    i += 1
                if i == len(lines):
                    raise DocsError(f"{_rel(path)}:{start + 1}: docs-test comment never closed")
                parts.append(lines[i].split("-->")[0])
                body = "\n".join(parts)
            found = re.match(r"\s*(\S+)\s?(.*)", body, re.DOTALL)
            key, value = (found.group(1), found.group(2)) if found else ("", "")
            if key not in KEYS:
                raise DocsError(f"{_rel(path)}:{start + 1}: unknown docs-test directive {key!r}")
            pending.append((key, value.strip("\n") if key == "prelude" else value.strip()))
            pending_line = pending_line or start + 1
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence:
            indent, mark, lang = fence.group("indent", "fence", "lang")
            body_lines = []
            i += 1
            while i < len(lines):
                closing = lines[i].strip()
                if closing.startswith(mark[0] * len(mark)) and set(closing) == {mark[0]}:
                    break
                text = lines[i]
                body_lines.append(text[len(indent) :] if text.startswith(indent) else text.lstrip())
                i += 1
            else:
                raise DocsError(f"{_rel(path)}:{i}: code block never closed")
            code = "\n".join(body_lines) + "\n"
            blocks.append(Block(path, i - len(body_lines), lang.lower(), code, pending))
            pending, pending_line = [], 0
            i += 1
            continue
        if pending and line.strip():
            raise DocsError(
                f"{_rel(path)}:{pending_line}: a docs-test directive must come right before "
                "a code block"
            )
        i += 1
    if pending:
        raise DocsError(f"{_rel(path)}:{pending_line}: a docs-test directive ends the page")
    return blocks


def _substitute(block: Block, code: str) -> str:
    port = str(_free_port())  # NEW may say {free_port}: one free TCP port for the whole block
    for sub in block.values("sub"):
        old, sep, new = sub.partition(" => ")
        new = new.replace("{free_port}", port)
        if not sep:
            raise DocsError(f"{block.where}: sub needs 'OLD => NEW', got {sub!r}")
        if old not in code:
            raise DocsError(f"{block.where}: sub: {old!r} does not occur in the block")
        code = code.replace(old, new)
    return code


def _split_comment(line: str) -> tuple[str, str]:
    """``line`` as (command, trailing ``# comment``), the comment outside quotes."""
    quote = ""
    for k, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip(), " " + line[k:]
    return line.rstrip(), ""


def _append(block: Block, code: str) -> str:
    """Each ``append CMD ARGS`` added to every logical line of ``code`` that starts with CMD."""
    rules = []
    for value in block.values("append"):
        words = shlex.split(value)
        if len(words) < 2:
            raise DocsError(f"{block.where}: append needs a command and arguments: {value!r}")
        rules.append((words[0], " ".join(shlex.quote(w) for w in words[1:])))
    if not rules:
        return code
    logical: list[list[str]] = []
    for line in code.splitlines():
        if logical and logical[-1][-1].rstrip().endswith("\\"):
            logical[-1].append(line)
        else:
            logical.append([line])
    used = {cmd: 0 for cmd, _ in rules}
    out: list[str] = []
    for group in logical:
        head = group[0].lstrip()
        last, comment = _split_comment(group[-1])
        tail = ""
        if last.endswith("&") and not last.endswith("&&"):
            last, tail = last[:-1].rstrip(), " &"
        for cmd, args in rules:
            if head.startswith(cmd + " ") or head.rstrip() == cmd:
                last = f"{last} {args}"
                used[cmd] += 1
        out.extend(group[:-1])
        out.append(last + tail + comment)
    for cmd, n in used.items():
        if not n:
            raise DocsError(f"{block.where}: append: no command starts with {cmd!r}")
    return "\n".join(out) + "\n"


def _env(block: Block) -> dict[str, str]:
    env: dict[str, str] = {}
    for value in block.values("env"):
        for item in shlex.split(value):
            key, sep, val = item.partition("=")
            if not sep:
                raise DocsError(f"{block.where}: env needs KEY=VALUE, got {item!r}")
            env[key] = val
    return env


def _single(block: Block, key: str, default: str) -> str:
    values = block.values(key)
    if len(values) > 1:
        raise DocsError(f"{block.where}: {key} given twice")
    return values[0] if values else default


def read_page(path: Path) -> Page:
    """The page's blocks turned into units, every rule of the module docstring checked."""
    blocks = read_blocks(path)
    units: list[Unit] = []
    skipped: list[tuple[Block, str]] = []
    same_as: list[tuple[Block, str]] = []
    slow = False
    last_python: Unit | None = None
    for b in blocks:
        if not b.lang:
            raise DocsError(f"{b.where}: a code block needs a language (python, bash, text...)")
        known = PYTHON | SHELL | DATA | TEXT
        if b.lang not in known:
            raise DocsError(f"{b.where}: language {b.lang!r} is none of {sorted(known)}")
        keys = {k for k, _ in b.directives}
        if "skip" in keys or "same-as" in keys:
            if len(b.directives) != 1:
                raise DocsError(f"{b.where}: skip / same-as stand alone")
            key, reason = b.directives[0]
            if key == "skip":
                if len(reason) < 12:
                    raise DocsError(f"{b.where}: skip needs a reason, got {reason!r}")
                skipped.append((b, reason))
            else:
                same_as.append((b, reason))
            continue
        slow = slow or "slow" in keys
        if "file" in keys:
            extra = keys - {"file", "sub", "slow"}
            if extra:
                raise DocsError(f"{b.where}: a file block takes no {sorted(extra)}")
            units.append(Unit("file", [b], _substitute(b, b.code), path=_single(b, "file", "")))
            continue
        if b.lang in TEXT:
            if keys - {"output"}:
                raise DocsError(f"{b.where}: a text block takes no directive but output or file")
            if "output" in keys:
                if not units or units[-1].kind == "file":
                    raise DocsError(f"{b.where}: output, but no block runs before it")
                lines = [x.strip() for x in b.code.splitlines()]
                units[-1].shown += [x for x in lines if x and x != "..."]
            continue
        if b.lang in DATA:
            raise DocsError(f"{b.where}: a {b.lang} block must be written (file) or skipped")
        code = _substitute(b, b.code)
        timeout = float(_single(b, "timeout", str(DEFAULT_TIMEOUT_S)))
        exit_code = int(_single(b, "exit", "0"))
        if b.lang in PYTHON:
            if "append" in keys:
                raise DocsError(f"{b.where}: append is for shell blocks")
            if "continue" in keys:
                if last_python is None:
                    raise DocsError(f"{b.where}: continue without a python block before it")
                if keys & {"ranks", "prelude", "env", "exit"}:
                    raise DocsError(f"{b.where}: a continued block runs as its first block does")
                last_python.blocks.append(b)
                last_python.code += "\n" + code
                last_python.expect += b.values("expect")
                last_python.timeout = max(last_python.timeout, timeout)
                continue
            prelude = "\n".join(b.values("prelude"))
            unit = Unit(
                "python",
                [b],
                (prelude + "\n" if prelude else "") + code,
                ranks=int(_single(b, "ranks", "1")),
                env=_env(b),
                expect=b.values("expect"),
                exit=exit_code,
                timeout=timeout,
            )
            last_python = unit
        else:
            if keys & {"ranks", "continue", "prelude"}:
                raise DocsError(f"{b.where}: ranks / continue / prelude are for python blocks")
            unit = Unit(
                "shell",
                [b],
                _append(b, code),
                env=_env(b),
                expect=b.values("expect"),
                exit=exit_code,
                timeout=timeout,
            )
        units.append(unit)
    for k, u in enumerate(units):
        if u.kind != "file":
            continue
        names = {u.path, Path(u.path).parts[0]}  # the file, or the folder it is written into
        if not any(n in later.code for n in names for later in units[k + 1 :]):
            raise DocsError(f"{u.where}: {u.path} is written but no later block uses it")
    return Page(path, blocks, units, skipped, same_as, slow)


def base_env(cache: Path) -> dict[str, str]:
    """The environment of every run: offline, CPU, caches in ``cache`` (shared by the pages)."""
    env = dict(os.environ)
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        LAYERSHARD_CACHE=str(cache / "layershard"),
        LAYERSHARD_TIMEOUT_S="120",
        CUDA_VISIBLE_DEVICES="",
        HF_HOME=str(cache / "hf"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        MPLBACKEND="Agg",
        PYTHONUNBUFFERED="1",
        # preludes import docs_support.fixtures (the guides' stand-ins for a user's files)
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")])),
    )
    return env


# Printed by every rank once the block's code has run to its end (the interpreter's exit follows).
_DONE = "docs-test: the code ran to its end on rank"
# One write: under PYTHONUNBUFFERED a print of several arguments writes each apart, and two
# ranks' lines interleave in the shared output.
_EPILOGUE = (
    "\n\nimport os as _os, sys as _sys\n"
    f"_sys.stdout.write('{_DONE} ' + _os.environ.get('RANK', '0') + '\\n')\n"
    "_sys.stdout.flush()\n"
)
# gloo's threads, destroyed with the interpreter, abort a rank now and then after a script ended
# well (the test helpers leave with os._exit for this reason); such an exit is let through,
# with a warning, when every rank had reached its end.
_TEARDOWN_ABORT = "terminate called without an active exception"


def _only_teardown_aborts(unit: Unit, code: int, output: str) -> bool:
    """Whether the run failed only because ranks aborted in gloo's teardown after every one of
    them had run the code to its end: a python unit's own ranks, or torchrun's in a shell
    unit (whose summary lists each failed rank and its signal; the others were stopped)."""
    if _TEARDOWN_ABORT not in output:
        return False
    done = set(re.findall(re.escape(_DONE) + r" (\d+)", output))
    if unit.kind == "python":
        return code == -signal.SIGABRT and len(done) == unit.ranks
    failed = re.findall(r"rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)", output)
    signals = {int(c) for _, c in failed}
    return (
        bool(failed)
        and -signal.SIGABRT in signals
        and signals <= {-signal.SIGABRT, -signal.SIGTERM}
        and {r for r, _ in failed} <= done
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(unit: Unit, workdir: Path, env: dict[str, str], out) -> list[subprocess.Popen]:
    """The unit's processes: bash, one python, or one python per rank with the environment
    torchrun gives its ranks (what ``ls.init_distributed()`` reads), without torchrun's own
    start-up cost."""
    common = dict(
        cwd=workdir, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,  # a group of its own: a timeout ends whatever it started
    )  # fmt: skip
    env = {**env, **unit.env}
    if unit.kind == "shell":
        return [
            subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", unit.code], env=env, **common)
        ]
    script = workdir / f"_docs_block_{unit.blocks[0].line}.py"
    script.write_text(unit.code + _EPILOGUE, encoding="utf-8")
    if unit.ranks == 1:
        return [subprocess.Popen([sys.executable, script.name], env=env, **common)]
    port = str(_free_port())
    procs = []
    for rank in range(unit.ranks):
        rank_env = dict(
            env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(unit.ranks),
            LOCAL_WORLD_SIZE=str(unit.ranks), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port, OMP_NUM_THREADS="1",
        )  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, script.name], env=rank_env, **common))
    return procs


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def run_unit(unit: Unit, workdir: Path, env: dict[str, str]) -> tuple[str, float]:
    """Run ``unit`` in ``workdir``; returns its output and seconds, or raises AssertionError."""
    if unit.kind == "file":
        target = workdir / unit.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(unit.code + (_EPILOGUE if unit.path.endswith(".py") else ""), "utf-8")
        return "", 0.0
    what = f"{unit.where} ({unit.kind}" + (f", {unit.ranks} ranks)" if unit.ranks > 1 else ")")
    start = time.perf_counter()
    log = workdir / f"_docs_output_{unit.blocks[0].line}.txt"
    with open(log, "w") as out:
        procs = _launch(unit, workdir, env, out)
        codes: list[int | None] = [None] * len(procs)
        try:
            while None in codes:
                if time.perf_counter() - start > unit.timeout:
                    raise TimeoutError
                for k, p in enumerate(procs):
                    codes[k] = p.poll()
                failed = [c for c in codes if c not in (None, 0)]
                if failed and None in codes:  # a rank failed: give the others a moment, then end
                    deadline = time.perf_counter() + 10
                    while None in codes and time.perf_counter() < deadline:
                        time.sleep(0.1)
                        codes = [p.poll() for p in procs]
                    break
                time.sleep(0.05)
        except TimeoutError:
            _end(procs)
            raise AssertionError(
                f"{what}: timed out after {unit.timeout:.0f} s\n{_tail(log.read_text())}"
            ) from None
        finally:
            _end(procs)
    output = log.read_text(errors="replace")
    seconds = time.perf_counter() - start
    code = next((c for c in codes if c not in (None, 0)), 0 if None not in codes else -9)
    if code != unit.exit and unit.exit == 0 and _only_teardown_aborts(unit, code, output):
        warnings.warn(
            f"{what}: a rank aborted at interpreter exit after the code ran to its end "
            f"({_TEARDOWN_ABORT!r}); let through",
            stacklevel=1,
        )
        code = 0
    if code != unit.exit:
        raise AssertionError(
            f"{what}: exit code {code}, expected {unit.exit}\n"
            f"--- code run ---\n{unit.code}--- output ---\n{_tail(output)}"
        )
    for line in unit.shown:
        if line not in output:
            raise AssertionError(
                f"{what}: a line of the output shown after it is not in the output: {line!r}\n"
                f"--- output ---\n{_tail(output)}"
            )
    for pattern in unit.expect:
        if not re.search(pattern, output, re.MULTILINE):
            raise AssertionError(
                f"{what}: the output does not match {pattern!r}\n--- output ---\n{_tail(output)}"
            )
    return output, seconds


def _tail(out: str, n: int = 6000) -> str:
    return out if len(out) <= n else "...\n" + out[-n:]


def run_page(page: Page, workdir: Path, cache: Path, log=None, verbose: bool = False) -> None:
    """Run every unit of ``page`` in order in ``workdir`` (a fresh folder)."""
    (workdir / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    # a recorded testbed bench, read by plan.md (read only: no page writes there)
    recorded = REPO / "benchmarks/links/wire-2x1"
    (workdir / "recorded-links").symlink_to(recorded, target_is_directory=True)
    env = base_env(cache)
    for unit in page.units:
        output, seconds = run_unit(unit, workdir, env)
        if log is not None and unit.kind != "file":
            log(f"{unit.where}: {unit.kind}, {seconds:.1f} s" + (f"\n{output}" if verbose else ""))


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    argv = [a for a in argv if a != "-v"]
    cache = Path(os.environ.get("DOCS_TEST_CACHE") or tempfile.mkdtemp(prefix="docs-cache-"))
    for name in argv or [str(p) for p in pages()]:
        page = read_page(Path(name).resolve())
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="docs-page-") as tmp:
            run_page(page, Path(tmp), cache, log=print, verbose=verbose)
        print(
            f"{page.name}: {time.perf_counter() - start:.1f} s ({'slow' if page.slow else 'fast'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
