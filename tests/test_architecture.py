"""The dependency rules of docs/architecture.md, read from the source (every import statement, also those inside
functions): trainer/ never imports infra or aws_cdk; infra/, app.py and catalog/ never import torch; the engine
names no task and imports no task package; planning reaches tasks only through the registry."""

from __future__ import annotations

import ast
import re
import sys
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


def test_every_commands_parser_is_built_without_torch():
    """`python -m trainer CMD --help` or a usage error answers before torch is imported (0.1 s, not 2-4 s): each
    sub-command's flags come from modules that do not import it (plan/probe: trainer.planning.options; write-ffcv:
    its writer imports the decoder and the ImageFolder scan only when it converts)."""
    import subprocess
    import sys

    code = (
        "import sys; from trainer.cli import COMMANDS, build_parser\n"
        "for c in COMMANDS:\n"
        "    build_parser(c)\n"
        "    assert 'torch' not in sys.modules, c + ' imported torch'\n"
        "print(len(COMMANDS))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 9


# --- the import graph: no circles, no import from a lower layer up --------------------------------------------
#: The layers of trainer/, lowest first (docs/architecture.md, ../shared/DESIGN.md: data flows down). A module
#: belongs to the layer of its longest listed prefix; it may import its own layer and the layers below it.
LAYERS = (
    ("trainer", "trainer.errors", "trainer.failures", "trainer.argtypes", "trainer.registry"),
    ("trainer.config",),
    ("trainer.ops",),
    ("trainer.data", "trainer.models"),
    ("trainer.engine.distributed", "trainer.engine.evaluation", "trainer.engine.precision"),
    ("trainer.tasks",),
    ("trainer.engine",),
    (
        "trainer.planning",
        "trainer.trained",
        "trainer.predict",
        "trainer.evaluate",
        "trainer.export",
        "trainer.export_verify",
        "trainer.model_card",
        "trainer.check_install",
    ),
    ("trainer.cli", "trainer.__main__", "trainer.sagemaker", "trainer.launch"),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST):
    """Import nodes that can run: every import statement but those under ``if TYPE_CHECKING:``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def import_graph(*tops: str) -> dict[str, dict[str, int]]:
    """module -> {imported module of the same tree: line}, from every runtime import (also inside functions).
    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``; an import of a module's
    own ancestor package is left out (importing ``a.b.c`` always runs ``a`` and ``a.b`` first)."""
    files = {_module_name(f): f for f in _py(*tops)}

    def resolve(name: str):
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, f in files.items():
        package = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in _runtime_imports(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else resolve(base) for a in node.names]
            for t in targets:
                if t and t != mod and not mod.startswith(t + "."):
                    edges.setdefault(t, node.lineno)
        graph[mod] = edges
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer_of(module: str) -> int:
    best, layer = "", -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, layer = p, i
    return layer


def test_the_import_graph_finds_a_planted_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks below can fail: a circle through a function-level import and an import from a lower layer up
    are both found in a planted tree (and a TYPE_CHECKING-only import is not an edge)."""
    pkg = tmp_path / "trainer"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("")
    (pkg / "config" / "a.py").write_text("def f():\n    from trainer.config import b\n")
    (pkg / "config" / "b.py").write_text("import trainer.config.a\nfrom trainer import cli\n")
    (pkg / "config" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import trainer.cli\n"
    )
    (pkg / "cli.py").write_text("from trainer.config import c\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph("trainer")
    assert import_circles(graph) == [["trainer.config.a", "trainer.config.b"]]
    assert graph["trainer.config.c"] == {}
    assert [(m, t) for m, e in graph.items() for t in e if layer_of(t) > layer_of(m)] == [
        ("trainer.config.b", "trainer.cli")
    ]


def test_no_import_circle_in_trainer_or_infra():
    assert import_circles(import_graph("trainer", "infra", "catalog")) == []


def test_no_trainer_module_imports_from_a_layer_above_its_own():
    graph = import_graph("trainer")
    assert all(layer_of(m) >= 0 for m in graph), [m for m in graph if layer_of(m) < 0]
    up = [
        f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)}) at line {line}"
        for m, edges in sorted(graph.items())
        for t, line in edges.items()
        if layer_of(t) > layer_of(m)
    ]
    assert up == []


# An internal ticket reference ("issue 24", "issue 53, N4", "gpu_issue50"): a reader of the repository cannot look
# it up. Another project's tracker is named as such ("PyTorch GitHub issue #13246", "W&B GitHub issues #3841").
_TICKET = re.compile(r"(?<![A-Za-z])issues?[\s_#-]*\d+", re.I)
_EXTERNAL = re.compile(r"GitHub\s+$", re.I)
_HISTORY_FREE = ("trainer", "infra", "benchmarks", "docs", "catalog", "images", "app.py", "Makefile")
_TEXT_SUFFIXES = {
    ".py",
    ".sh",
    ".md",
    ".txt",
    ".yaml",
    ".yml",
    ".toml",
    ".cfg",
    ".conf",
    ".json",
    ".c",
    ".cpp",
    ".cu",
    ".h",
    ".cuh",
    ".in",
    "",
}


def _ticket_references(text: str) -> list[str]:
    """Every internal ticket reference in ``text``; "GitHub issue #N" (another project's tracker) is allowed."""
    return [
        m.group(0) for m in _TICKET.finditer(text) if not _EXTERNAL.search(text[max(0, m.start() - 12) : m.start()])
    ]


def test_ticket_references_are_found_and_external_trackers_allowed():
    text = (
        "the staging before issue 24; issue 53, N4; gpu_issue50.sh; Issue 37 item 3; issues 25 and 26\n"
        "PyTorch GitHub issue #13246; W&B GitHub issues #3841 and #5865; no issue here; 2 issues"
    )
    assert _ticket_references(text) == ["issue 24", "issue 53", "issue50", "Issue 37", "issues 25"]


def test_no_internal_ticket_reference_in_the_product():
    """Code, comments and docs say what and why, not which ticket asked (a decision that needs its story is in
    docs/architecture.md, "Dated decisions")."""
    found = []
    for part in _HISTORY_FREE:
        p = ROOT / part
        files = [p] if p.is_file() else sorted(p.rglob("*"))
        for f in files:
            skip = {"__pycache__", "node_modules", "cdk.out", "build"} & set(f.relative_to(ROOT).parts)
            if skip or not f.is_file() or f.suffix not in _TEXT_SUFFIXES:
                continue
            try:
                lines = f.read_text().splitlines()
            except UnicodeDecodeError:
                continue
            found += [
                f"{f.relative_to(ROOT)}:{n}: {r}" for n, line in enumerate(lines, 1) for r in _ticket_references(line)
            ]
    assert found == []
