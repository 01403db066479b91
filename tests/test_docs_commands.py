"""Every command in README.md and docs/*.md runs as the page shows it, offline on the CPU.

Sybil (docs/architecture.md, "Testing the docs") finds the fenced blocks: a ```bash block runs as one bash script
and must exit 0; a ```console block runs each ``$ `` command (continued over ``\\`` line ends and open quotes) and
each output line shown must be one that the command printed (stdout or stderr), ``...`` standing for
anything within a line or for lines left out; a command that shows a failure ends in ``; echo "exit $?"`` so that the
status is part of the output. A block that needs AWS, a GPU, the image build or a long run carries
``<!-- skip: next "why" -->`` and is reported as skipped with that reason.

Each block runs in its own folder: a copy of the checkout's top level made of symbolic links (so ``configs/...``,
``.venv/bin/python`` and ``../shared/data`` resolve as they do in the checkout) where ``runs/`` and ``exported/``
are new, empty folders; the venv's bin comes first on PATH.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from tests import forkserver

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Seconds one documented command may take before the test fails.
COMMAND_TIMEOUT_S = 300
#: Top-level entries of the checkout that a block's folder does not link: what a documented command writes.
WRITTEN = {"runs", "exported", ".git"}


def split_console(source: str) -> list[tuple[str, list[str]]]:
    """The ``$ `` commands of a console block with the output lines shown after each: ``[(command, lines)]``.

    A command goes on over the next lines while it ends in a backslash or leaves a quote open (``shlex``)."""
    items: list[tuple[str, list[str]]] = []
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            if items:
                items[-1][1].append(line)
            elif line.strip():
                raise ValueError(f"console block: output before the first '$ ' command: {line!r}")
            i += 1
            continue
        command = line[2:]
        while command.endswith("\\") or _open_quote(command):
            i += 1
            if i == len(lines):
                raise ValueError(f"console block: command not closed: {command!r}")
            command += "\n" + lines[i]
        items.append((command, []))
        i += 1
    return items


def _open_quote(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return True
    return False


def _line_pattern(shown: str) -> re.Pattern:
    parts = re.split(r"\.\.\.|…", shown.strip())
    return re.compile(r"\s*" + ".*".join(re.escape(p) for p in parts) + r"\s*")


def missing_lines(shown: list[str], printed: str) -> list[str]:
    """The shown lines that no line of ``printed`` matches (``...`` inside a line matches anything there; a line
    of ``...`` alone stands for lines left out); an empty list when all are there. Order is not checked: stdout
    and stderr come back apart from a forked command."""
    out = printed.splitlines()
    return [
        line
        for line in shown
        if line.strip() not in ("", "...", "…") and not any(_line_pattern(line).fullmatch(o) for o in out)
    ]


def _sandbox(folder: Path) -> Path:
    repo = folder / "repo"
    repo.mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name not in WRITTEN:
            (repo / entry.name).symlink_to(entry)
    (folder / "shared").symlink_to(ROOT.parent / "shared")
    return repo


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTHONPATH", None)
    return env


#: Shell syntax that a forked ``python -m trainer`` could not honour.
SHELL_SYNTAX = re.compile(r"[;|&<>$`]")


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """``command`` through bash, or a plain ``python -m trainer ...`` through tests/forkserver.py (torch imported
    once per test worker instead of once per command); stdout then stderr in ``.stdout``."""
    try:
        argv = shlex.split(command.replace("\\\n", " "), comments=True)
    except ValueError:
        argv = []
    if (
        len(argv) > 2
        and Path(argv[0]).name in ("python", "python3")
        and argv[1:3] == ["-m", "trainer"]
        and not SHELL_SYNTAX.search(command)
        and "=" not in argv[0]
    ):
        proc = forkserver.run([sys.executable, *argv[1:]], cwd, _env(), COMMAND_TIMEOUT_S)
        return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout + proc.stderr)
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )


def _where(example) -> str:
    return f"{Path(example.path).relative_to(ROOT)}:{example.line}"


def evaluate_bash(example) -> None:
    cwd = _sandbox(example.namespace["folder"])
    proc = _run("set -e\n" + example.parsed, cwd)
    assert proc.returncode == 0, f"{_where(example)}: exit {proc.returncode}\n{proc.stdout[-4000:]}"


def evaluate_console(example) -> None:
    cwd = _sandbox(example.namespace["folder"])
    for command, shown in split_console(example.parsed):
        proc = _run(command, cwd)
        assert proc.returncode == 0, f"{_where(example)}: {command!r}: exit {proc.returncode}\n{proc.stdout[-4000:]}"
        missing = missing_lines(shown, proc.stdout)
        assert not missing, f"{_where(example)}: {command!r} did not print {missing[0]!r}\n{proc.stdout[-4000:]}"


SYBIL = Sybil(
    parsers=[
        SkipParser(),
        CodeBlockParser("bash", evaluate_bash),
        CodeBlockParser("console", evaluate_console),
    ],
)


def _examples() -> list:
    params = []
    for doc in DOCS:
        examples = list(SYBIL.parse(doc))
        for k, example in enumerate(examples):
            if example.region.evaluator is not None and isinstance(example.parsed, tuple):
                continue  # a skip directive: evaluated with the block it precedes
            before = examples[k - 1] if k and isinstance(examples[k - 1].parsed, tuple) else None
            params.append(pytest.param(before, example, id=f"{doc.relative_to(ROOT)}:{example.line}"))
    return params


@pytest.mark.parametrize("directive, example", _examples())
def test_documented_command(directive, example, tmp_path):
    example.namespace["folder"] = tmp_path
    if directive is not None:
        directive.evaluate()
    example.evaluate()


#: An unlabelled fence whose first line starts so is a command that the test above would not run.
COMMAND_START = re.compile(r"^(\$ |make |npx |python3? |\.venv/|torchrun |PYTHONPATH=|bash |docker |cd )")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_block_is_labelled(doc):
    """A command shown in a fence without ``bash`` or ``console`` would be neither run nor skipped with a reason."""
    unlabelled, lines, info = [], doc.read_text().splitlines(), None
    for n, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(.*)$", line)
        if fence and info is None:
            info, first = fence.group(1).strip(), n
        elif fence:
            info = None
        elif info == "" and n == first + 1 and COMMAND_START.match(line.strip()):
            unlabelled.append(f"{doc.relative_to(ROOT)}:{first}: {line.strip()[:80]}")
    assert unlabelled == []


PATH_REF = re.compile(
    r"(?<![\w/.-])((?:tests|benchmarks|trainer|infra|configs|images|docs)/(?:[\w.-]+/)*(?:[\w-]+\.\w+|[\w-]+/))"
)


#: Paths the pages name that are not files of this checkout: a layout's placeholders, the Deep Learning
#: Containers repository's own paths, what the op's build writes.
NOT_FILES_HERE = {
    "images/N.png",
    "images/X.png",
    "docs/src/data/pytorch/2.13",
    "docs/src/data/pytorch/2.14",
    "trainer/ops/msda/_C.cpython",
    "trainer/ops/msda/build/cuda-library-headers/",
}


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces as
    ``-`` (GitHub's heading-id rules, as its Markdown renderer applies them)."""
    heads = re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "requirements.txt"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_file_exists(doc):
    """Each repository path the page names (``tests/...``, ``trainer/...``, a relative link and its ``#anchor``,
    a ``*.md`` file named in requirements.txt) exists."""
    text = doc.read_text()
    named = set(PATH_REF.findall(text))
    links = {m for m in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in m}
    named |= {m.split("#")[0] for m in links if not m.startswith("#")}
    if doc.suffix == ".txt":
        named |= set(re.findall(r"[\w./-]+\.md\b", text))
    base = doc.parent
    gone = sorted(
        p
        for p in named - NOT_FILES_HERE
        if not (ROOT / p).exists() and not (base / p).exists() and not any(c in p for c in "*<{")
    )
    assert gone == []
    broken = []
    for link in sorted(m for m in links if "#" in m):
        page, anchor = link.split("#", 1)
        target = (base / page) if page else doc
        if target.suffix == ".md" and target.exists() and anchor not in heading_anchors(target.read_text()):
            broken.append(link)
    assert broken == []
