"""The user docs cannot drift from the code: every code block of README.md and docs/ runs.

How blocks run, and the directives that say how (``<!-- docs-test: ... -->`` comments before a
block): tests/docs_support/blocks.py. One test per page runs its blocks in order in a fresh
folder, on tiny shapes; a page with a heavy block (``<!-- docs-test: slow -->``) is in the slow
tier. The other tests here read the docs only: every block is run or exempt with a reason, no
issue numbers or commit hashes, no flag that the commands do not have, links to benchmarks/ go
to its topic folders. ``mkdocs build --strict`` is not repeated here: CI runs it (README).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from docs_support.blocks import REPO, DocsError, pages, read_page, run_page

PAGES = {p: read_page(p) for p in pages()}


def _page_param(path: Path):
    page = PAGES[path]
    marks = [pytest.mark.slow] if page.slow else []
    return pytest.param(page, id=page.name, marks=marks)


@pytest.fixture(scope="session")
def docs_cache(tmp_path_factory) -> Path:
    """Caches every page shares: the BPE and tokenized corpus of `layershard train`, HF's."""
    return tmp_path_factory.mktemp("docs-cache")


@pytest.mark.parametrize(
    "page",
    [
        _page_param(p)
        for p in PAGES
        if PAGES[p].units and any(u.kind != "file" for u in PAGES[p].units)
    ],
)
def test_page_code_runs(page, tmp_path, docs_cache) -> None:
    """Every block of the page, in order: exit codes and the outputs the text claims."""
    run_page(page, tmp_path, docs_cache)


# ---- the docs read, not run --------------------------------------------------------------------

MAX_EXEMPT = 12  # blocks skipped (other machines, GPUs, installs, the suite itself): keep it small


def _code_line(line: str) -> str:
    """A line of code without its trailing comment and surrounding spaces."""
    return re.sub(r"\s+#\s.*$", "", line).strip()


def test_every_block_runs_or_says_why_not() -> None:
    """Parsing every page applies the rules (a language per block, data blocks used, no stray
    directive); here: the exemptions are few, and a ``same-as`` block's lines run elsewhere."""
    skipped = [(b.where, reason) for p in PAGES.values() for b, reason in p.skipped]
    assert len(skipped) <= MAX_EXEMPT, f"{len(skipped)} blocks skipped: {skipped}"
    for page in PAGES.values():
        for block, target in page.same_as:
            other = PAGES.get((REPO / target).resolve())
            assert other is not None, f"{block.where}: same-as {target}: no such page"
            run_lines = {
                _code_line(x) for u in other.units for b in u.blocks for x in b.code.splitlines()
            }
            missing = [
                x for x in map(_code_line, block.code.splitlines()) if x and x not in run_lines
            ]
            assert not missing, f"{block.where}: not in a block that {target} runs: {missing}"
    run = sum(len(u.blocks) for p in PAGES.values() for u in p.units)
    assert run >= 50, f"only {run} blocks run"


def test_directive_errors_are_caught(tmp_path) -> None:
    """A block without a language, an unused data block, a directive before prose: errors."""
    bad = {
        "no language": "```\nls\n```\n",
        "unused data": "<!-- docs-test: file a.yaml -->\n```yaml\na: 1\n```\n",
        "stray": "<!-- docs-test: slow -->\nsome prose\n",
        "sub that does not match": "<!-- docs-test: sub x => y -->\n```bash\nls\n```\n",
        "unknown": "<!-- docs-test: skipp because -->\n```bash\nls\n```\n",
        "data not written": "```yaml\na: 1\n```\n",
    }
    for what, text in bad.items():
        page = tmp_path / "bad.md"
        page.write_text(text)
        with pytest.raises(DocsError):
            read_page(page)
            pytest.fail(f"not caught: {what}")


# User-facing text names no issue, no stop of a work session, no commit. Allowed tokens that
# look like hashes (e.g. a SHA-256 in an example error) go here, with why.
HASH_ALLOWED: set[str] = set()
_ISSUE = re.compile(r"\b(issue|stop)s?\s+#?\d+", re.IGNORECASE)
_HASHLIKE = re.compile(r"(?<![\w.])[0-9a-f]{7,40}(?!\w)")
_NUMBER_SIGN = re.compile(r"(?<![\w&/])#\d+\b")
NUMBER_SIGN_ALLOWED = ("collective #",)  # layershard train's stall report numbers collectives


def _user_texts() -> list[Path]:
    return [*pages(), REPO / "mkdocs.yml"]


def test_no_issue_numbers_or_commit_hashes() -> None:
    problems = []
    for path in _user_texts():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.relative_to(REPO)}:{n}"
            problems += [f"{where}: {m.group(0)!r}" for m in _ISSUE.finditer(line)]
            for m in _HASHLIKE.finditer(line):
                token = m.group(0)
                looks_like_a_hash = re.search(r"\d", token) and re.search(r"[a-f]", token)
                if looks_like_a_hash and token not in HASH_ALLOWED:
                    problems.append(f"{where}: {token!r} looks like a commit hash")
            for m in _NUMBER_SIGN.finditer(line):
                before = line[: m.start()]
                if not any(before.endswith(a.rstrip("#")) for a in NUMBER_SIGN_ALLOWED):
                    problems.append(f"{where}: {m.group(0)!r} looks like an issue number")
    assert not problems, "\n".join(problems)


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail into docs/"


# Benchmarks live in topic folders with a README each; the docs point at folders, not files.
_BENCH_REF = re.compile(r"benchmarks/[A-Za-z0-9_./-]*")


def test_benchmark_references_are_topic_folders() -> None:
    problems = []
    for path in pages():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in _BENCH_REF.finditer(line):
                ref = m.group(0).rstrip(".")
                parts = [p for p in ref.split("/")[1:] if p]
                ok = (not parts or parts == ["README.md"]) or (
                    len(parts) == 1 and ref.endswith("/") and (REPO / ref).is_dir()
                )
                if not ok:
                    problems.append(f"{path.relative_to(REPO)}:{n}: {ref!r}")
    assert not problems, (
        "link to a topic folder of benchmarks/ (benchmarks/<topic>/) that exists:\n"
        + "\n".join(problems)
    )


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def _layershard_flags() -> set[str]:
    from layershard.cli import SUBCOMMANDS, build_parser

    flags: set[str] = set()
    for name in SUBCOMMANDS:
        flags |= _options(build_parser([name]))
    return flags


# Flags of other programs the docs name: torchrun, accelerate, ruff, mkdocs, the example scripts (their own and
# TrainingArguments'), tensorboard and Slurm.
OTHER_FLAGS = {
    "--standalone", "--use_fsdp", "--use_deepspeed", "--logdir", "--check", "--strict",
    "--output_dir", "--use_cpu", "--no_layershard", "--max_steps", "--bf16", "--merged",
    "--model_name_or_path", "--train_files", "--model_size", "--dp-replicate",
    "--job-name", "--nodes", "--ntasks-per-node", "--cpus-per-task", "--time", "--signal",
    "--requeue", "--kill-on-bad-exit",
}  # fmt: skip


def test_documented_flags_exist() -> None:
    """Every ``--flag`` the docs name is one of layershard's commands' (or another program's
    in OTHER_FLAGS): a renamed or removed flag fails here, in prose and tables too."""
    known = _layershard_flags() | OTHER_FLAGS
    problems = []
    for path in pages():
        text = path.read_text(encoding="utf-8")
        for n, line in enumerate(text.splitlines(), 1):
            for m in re.finditer(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", line):
                if m.group(0) not in known:
                    problems.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)}")
    assert not problems, "flags no command has:\n" + "\n".join(problems)


def test_quickstart_test_command_is_the_readme_s() -> None:
    """The site's Quickstart shows the test command CI runs; the README's is the original."""

    def command(page: Path) -> str:
        found = [b.code for b in PAGES[page].blocks if "ruff format --check" in b.code]
        assert len(found) == 1, f"{page.relative_to(REPO)}: {len(found)} test commands"
        return found[0]

    assert command(REPO / "docs" / "quickstart.md") == command(REPO / "README.md")


def test_ci_runs_the_readme_s_test_command() -> None:
    """``.ci/run`` calls the README's test command as written, nothing hand-made."""
    readme = [b.code for b in PAGES[REPO / "README.md"].blocks if "ruff format --check" in b.code]
    assert len(readme) == 1
    assert readme[0].strip() in (REPO / ".ci" / "run").read_text(encoding="utf-8")


def test_a_rank_s_end_marker_is_one_write(monkeypatch) -> None:
    """Each rank's "ran to its end" line reaches the shared output in one write: with
    PYTHONUNBUFFERED a print of several arguments writes each apart, two ranks' lines
    interleaved ("...on rank docs-test: ...on rank0\\n 1"), and a run that ended well but for
    gloo's teardown abort was failed (seen in CI, docs/training-loop.md)."""
    import io
    import sys

    from docs_support import blocks

    class Writes(io.StringIO):
        calls: list[str] = []

        def write(self, s: str) -> int:
            self.calls.append(s)
            return len(s)

    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setenv("RANK", "1")
    exec(blocks._EPILOGUE, {})
    assert out.calls == [f"{blocks._DONE} 1\n"], out.calls
