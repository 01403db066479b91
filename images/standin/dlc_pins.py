"""Write the stand-in's package pins from the Deep Learning Container's own lock file.

    python images/standin/dlc_pins.py UV_LOCK  > images/standin/dlc-packages.txt

UV_LOCK: ``docker/pytorch/2.13/cuda/uv.lock`` of aws/deep-learning-containers (``fetch`` it; e.g. ``git --git-dir
<mirror> show HEAD:docker/pytorch/2.13/cuda/uv.lock > /tmp/uv.lock``). The DLC's Dockerfile.cuda installs that lock
twice: ``uv sync --frozen --no-dev --no-install-project`` (the project's dependencies) in builder-base, then ``uv
sync --frozen --no-dev --extra sagemaker --no-install-project --inexact`` in the sagemaker stage. This script walks
the same closure (the ``pytorch-dlc`` project's dependencies plus its ``sagemaker`` extra, markers evaluated for
CPython 3.12 on x86_64 Linux, as the DLC) and prints ``name==version`` for every package, the local ``+cu130`` tags
dropped (PyPI's torch 2.13.0 is the CUDA 13.0 build). Packages that the lock records without wheels (sdists:
built at install) are printed last, after a ``# sdists`` line: the Containerfile builds them separately, without
build isolation (deepspeed's setup.py imports torch). Standard library only (``tomllib``; ``packaging`` for markers).
"""

from __future__ import annotations

import sys
import tomllib

from packaging.markers import Marker

ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.12",
    "sys_platform": "linux",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}


def pick(entries: list[dict], dep: dict) -> dict:
    """The lock's entry that ``dep`` (a dependency table: ``name``, and ``version`` where the lock holds several
    versions of that name) means on the DLC's platform: the one of ``dep``'s version, else the one whose
    ``resolution-markers`` (uv's forks of the resolution) match :data:`ENV`, or that has none. uv.lock holds two
    versions of a package when they differ by platform (shap 0.50.0 for macOS x86_64, 0.51.0 elsewhere), and the
    order of the entries says nothing. Raises ValueError unless exactly one entry fits."""
    fits = [p for p in entries if p["version"] == dep["version"]] if "version" in dep else entries
    if len(fits) > 1:
        fits = [
            p
            for p in fits
            if not p.get("resolution-markers") or any(Marker(m).evaluate(ENV) for m in p["resolution-markers"])
        ]
    if len(fits) != 1:
        found = [p["version"] for p in fits]
        raise ValueError(f"{dep['name']}: {len(fits)} lock entries fit Python 3.12 on x86_64 Linux {found}")
    return fits[0]


def closure(lock: dict, project: str = "pytorch-dlc", extras: tuple[str, ...] = ("sagemaker",)) -> dict[str, dict]:
    """The lock's packages that ``uv sync --extra <extras>`` of ``project`` installs on the DLC's platform:
    name -> the lock's package table (:func:`pick` chooses among a name's entries). Raises KeyError when the lock
    has no ``project``, ValueError when a name's entry is ambiguous."""
    packages: dict[str, list[dict]] = {}
    for p in lock["package"]:
        packages.setdefault(p["name"], []).append(p)

    def wanted(dep: dict) -> bool:
        return "marker" not in dep or Marker(dep["marker"]).evaluate(ENV)

    root = packages[project][0]
    todo = [d for d in root.get("dependencies", []) if wanted(d)]
    for extra in extras:
        todo += [d for d in root.get("optional-dependencies", {}).get(extra, []) if wanted(d)]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    chosen: dict[str, dict] = {}
    while todo:
        dep = todo.pop()
        key = (dep["name"], tuple(dep.get("extra", [])))
        if key in seen:
            continue
        seen.add(key)
        pkg = pick(packages[dep["name"]], dep)
        if chosen.setdefault(dep["name"], pkg) is not pkg:
            raise ValueError(f"{dep['name']}: required at {chosen[dep['name']]['version']} and {pkg['version']}")
        todo += [d for d in pkg.get("dependencies", []) if wanted(d)]
        for extra in key[1]:
            todo += [d for d in pkg.get("optional-dependencies", {}).get(extra, []) if wanted(d)]
    return dict(sorted(chosen.items()))


def main(path: str) -> int:
    with open(path, "rb") as f:
        chosen = closure(tomllib.load(f))
    pins = {name: pkg["version"].split("+")[0] for name, pkg in chosen.items()}
    wheels = [n for n, p in chosen.items() if p.get("wheels")]
    sdists = [n for n, p in chosen.items() if not p.get("wheels")]
    print(
        f"# {len(chosen)} packages of the pytorch 2.13 DLC (SageMaker extra) from its uv.lock: images/standin/dlc_pins.py"
    )
    print("\n".join(f"{n}=={pins[n]}" for n in wheels))
    print("# sdists")
    print("\n".join(f"{n}=={pins[n]}" for n in sdists))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]) if len(sys.argv) == 2 else (print(__doc__, file=sys.stderr) or 2))
