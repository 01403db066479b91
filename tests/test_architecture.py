"""The dependency rules of docs/architecture.md, read from the source (every import statement, also those inside
functions): trainer/ never imports infra or aws_cdk; infra/, app.py and catalog/ never import torch; the engine
names no task and imports no task package; planning reaches tasks only through the registry."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from trainer.tasks import task_names

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``; ``from X import y`` yields X and X.y."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _py(*parts: str) -> list[Path]:
    files = []
    for part in parts:
        p = ROOT / part
        files += [p] if p.is_file() else sorted(f for f in p.rglob("*.py") if "build" not in f.parts)
    assert files, parts
    return files


def _violations(files: list[Path], banned: tuple[str, ...]) -> list[str]:
    return [
        f"{f.relative_to(ROOT)}:{line}: imports {mod}"
        for f in files
        for line, mod in _imports(f)
        if mod.split(".")[0] in banned or any(mod == b or mod.startswith(b + ".") for b in banned)
    ]


def test_trainer_never_imports_infra_or_the_cdk():
    assert _violations(_py("trainer"), ("infra", "aws_cdk", "constructs", "cdk_nag", "boto3")) == []


def test_infra_app_and_catalog_never_import_torch():
    assert (
        _violations(
            _py("infra", "app.py", "catalog"),
            ("torch", "torchvision", "trainer.engine", "trainer.tasks", "trainer.planning"),
        )
        == []
    )


def test_the_engine_names_no_task_and_imports_no_task_package():
    names = task_names()
    assert "classification" in names
    allowed = {
        "trainer.tasks",
        "trainer.tasks.base",
        "trainer.tasks.build_task",
        "trainer.tasks.base.StepOutput",
        "trainer.tasks.base.Task",
    }
    bad = []
    for f in _py("trainer/engine"):
        bad += [
            f"{f.relative_to(ROOT)}:{line}: imports {mod}"
            for line, mod in _imports(f)
            if (mod.startswith("trainer.tasks") and mod not in allowed) or mod.startswith("trainer.data.formats")
        ]
        text = f.read_text().lower()
        bad += [f"{f.relative_to(ROOT)}: names task {n!r}" for n in names if re.search(rf"\b{n}\b", text)]
    assert bad == []


@pytest.mark.parametrize("package", ["trainer/planning", "trainer/sagemaker", "trainer/data"])
def test_outside_tasks_no_module_imports_a_task_package(package):
    bad = [
        f"{f.relative_to(ROOT)}:{line}: imports {mod}"
        for f in _py(package)
        for line, mod in _imports(f)
        if any(mod == f"trainer.tasks.{n}" or mod.startswith(f"trainer.tasks.{n}.") for n in task_names())
    ]
    assert bad == []


def test_task_registry_and_config_are_importable_without_torch(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys, trainer.tasks, trainer.config; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(trainer.tasks.task_names())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "classification" in out.stdout
