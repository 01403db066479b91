"""``python -m trainer ...`` for the tests without paying the interpreter and torch start-up each time.

A test that runs the trainer's command line as a subprocess spends ~4-6 s of its 2-vCPU machine importing torch,
torchvision and the trainer before the first line of its own work; the bad-input tables alone start ~80 such
commands. :func:`run` hands ``[sys.executable, "-m", "trainer", ...]`` (and torchrun's launcher, ``[sys.executable,
"-m", "torch.distributed.run", ...]``, whose ranks stay fresh interpreters) to a server process (one per pytest
worker, started on first use) that imported them once and forks one child per command; the child runs the command as
the interpreter would (``__main__``, ``sys.argv``, ``sys.path[0]`` = the working directory, the environment, stdin
from /dev/null, its own process group; non-daemon threads joined and ``atexit`` handlers run before it exits) and
its stdout and stderr come back as a :class:`subprocess.CompletedProcess`, exactly as ``subprocess.run(...,
capture_output=True, text=True)`` returns them. The server never runs a torch operation, so no thread pool exists
when it forks.

``PYTHONPATH`` is applied as a fresh interpreter applies it: ``sys.path`` = the working directory, its entries, then
the interpreter's own (the server's without its ``PYTHONPATH``). A command that needs a fresh interpreter runs as a
real subprocess instead: another program or module, a ``PYTHONPATH`` folder holding a top-level module the server
already imported (the image-layout test's copy of ``trainer``, say), an environment that changes how an interpreter
starts (``PYTHON*`` but PYTHONPATH and PYTHONUNBUFFERED, ``LD_*``), or ``TRAINSTACK_TEST_FORK=0`` (the whole suite
the old way: what to set to rule the server out when a test fails only here). ``OMP_NUM_THREADS`` is applied with
``torch.set_num_threads`` in the child. ``benchmarks/gpu_suite.py --small`` forks its steps with :func:`run_as_main`
and :func:`exit_like_the_interpreter`, the same child body.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
_START_KEYS = ("PYTHON", "LD_")
_IGNORED = {"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"}


def run_as_main(argv: list[str], cwd: Path) -> int:
    """Run ``argv`` (``[python, "-m", module, ...]``, ``[python, "-c", code, ...]`` or ``[python, script, ...]``)
    in this process as the interpreter would run it from ``cwd``; returns the exit status it would have (0, the
    ``SystemExit`` code, or 1 after printing an uncaught exception through ``sys.excepthook``). Call it only in a
    forked child: it changes ``sys.argv``, ``sys.path[0]``, ``__main__`` and the working directory."""
    import runpy

    os.chdir(cwd)
    try:
        if argv[1] == "-m":
            sys.argv, sys.path[0] = [argv[2], *argv[3:]], os.getcwd()
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        elif argv[1] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[3:]], ""
            exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv, sys.path[0] = argv[1:], str(Path(argv[1]).resolve().parent)
            runpy.run_path(argv[1], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1


def exit_like_the_interpreter(code: int) -> None:
    """What ``Py_FinalizeEx`` does before the process ends: join non-daemon threads, run ``atexit`` handlers,
    flush stdio; then ``os._exit(code)`` (never the parent's cleanup)."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _child(req: dict) -> None:
    """The forked child of the server: never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[:] = ["", *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p), *_BASE_PATH]
        import random

        import torch

        random.seed()
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        code = run_as_main(req["argv"], Path(req["cwd"]))
    finally:
        exit_like_the_interpreter(code)


def wait_child(pid: int, timeout: float) -> Optional[int]:
    """The child's exit status (negative: killed by that signal), or None after killing its process group
    when ``timeout`` seconds pass."""
    import signal

    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)


def _entries(pythonpath: str) -> list[str]:
    """The absolute folders a ``PYTHONPATH`` value puts on ``sys.path``, in order."""
    return [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]


def _top_level_names(folder: str) -> set[str]:
    """Names ``import NAME`` could find in ``folder``: packages, namespace folders, modules, extensions."""
    try:
        names = os.listdir(folder)
    except OSError:
        return set()
    out = set()
    for n in names:
        if os.path.isdir(os.path.join(folder, n)):
            out.add(n)
        elif n.endswith((".py", ".so", ".pyc")):
            out.add(n.split(".")[0])
    return out


_BASE_PATH: list[str] = []
#: The ``python -m MODULE`` commands :func:`run` forks: the trainer's command line, and torchrun's launcher (its
#: ranks are still fresh interpreters: the launcher starts them with ``subprocess``; only its own start-up is saved).
FORKED_MODULES = ("trainer", "torch.distributed.run")


def serve() -> None:
    """The server's loop: import torch, torchvision, the trainer's command line and what every training run
    imports later (TensorBoard's writer, matplotlib's pyplot with the Agg backend) once, then one JSON request
    per stdin line (argv, cwd, env, timeout, stdout and stderr paths) answered by one JSON line ``{"rc": N}``
    (``{"rc": null}`` after a timeout) on stdout. Ends when stdin closes."""
    import matplotlib
    import torch  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401 - and boto3, which TensorBoard imports for its S3 file system
    import torchvision  # noqa: F401

    import trainer.cli  # noqa: F401
    import trainer.engine.trainer  # noqa: F401

    matplotlib.use("Agg")  # as trainer.engine.logging.plot_curves does before its import of pyplot
    import matplotlib.pyplot  # noqa: F401

    own = set(_entries(os.environ.get("PYTHONPATH", "")))
    _BASE_PATH[:] = [p for p in sys.path[1:] if os.path.abspath(p or ".") not in own]
    out = sys.stdout
    out.write(json.dumps({"modules": sorted({m.split(".")[0] for m in sys.modules})}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        out.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        out.write(json.dumps({"rc": wait_child(pid, req["timeout"])}) + "\n")
        out.flush()


class _Server:
    """The pytest worker's side: the server process and the request/answer pipes."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.env = env
        code = "from tests.forkserver import serve; serve()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        atexit.register(self.close)
        first = self.proc.stdout.readline()
        self.imported = set(json.loads(first)["modules"]) if first else set()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def forkable(self, env: dict) -> bool:
        """Whether a ``python -m trainer`` command with ``env`` runs the same in a fork of the server as in a fresh
        interpreter (:func:`run` checks the command and ``TRAINSTACK_TEST_FORK``)."""
        keys = {k for k in (*env, *self.env) if k.startswith(_START_KEYS) and k not in _IGNORED}
        if not all(env.get(k) == self.env.get(k) for k in keys) or self.proc.poll() is not None:
            return False
        extra = set(_entries(env.get("PYTHONPATH", ""))) - set(_entries(self.env["PYTHONPATH"]))
        return not any(_top_level_names(folder) & self.imported for folder in extra)

    def run(self, argv: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
            paths = {"stdout": os.path.join(tmp, "out"), "stderr": os.path.join(tmp, "err")}
            req = {"argv": argv, "cwd": str(cwd), "env": env, "timeout": timeout, **paths}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
            if not answer:
                raise RuntimeError(f"the fork server ended (exit {self.proc.wait()}); TRAINSTACK_TEST_FORK=0 avoids it")
            rc = json.loads(answer)["rc"]
            text = {k: Path(p).read_text(errors="replace") if os.path.exists(p) else "" for k, p in paths.items()}
        if rc is None:
            raise subprocess.TimeoutExpired(argv, timeout, output=text["stdout"], stderr=text["stderr"])
        return subprocess.CompletedProcess(argv, rc, text["stdout"], text["stderr"])


_server: Optional[_Server] = None


def run(argv: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)``, forked from
    the server when the command allows it (module doc). Raises subprocess.TimeoutExpired like subprocess.run."""
    global _server
    forked = argv[:2] == [sys.executable, "-m"] and len(argv) > 2 and argv[2] in FORKED_MODULES
    if forked and os.environ.get("TRAINSTACK_TEST_FORK", "1") != "0":
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        if _server.forkable(env):
            return _server.run(argv, cwd, env, timeout)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
