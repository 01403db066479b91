"""Write what the Deep Learning Container's recipe gives its SageMaker image, for the stand-in's test to compare with.

    python images/standin/dlc_recipe.py DOCKERFILE CONFIG COMMIT > images/standin/dlc-recipe.json

DOCKERFILE: ``docker/pytorch/Dockerfile.cuda`` of aws/deep-learning-containers; CONFIG: its
``.github/config/image/pytorch/2.13-sagemaker-cuda.yml`` (the ``build:`` block gives the ARG values CI passes);
COMMIT: the DLC repository's commit they were read from (``fetch`` it; e.g. ``git --git-dir <mirror> show
HEAD:docker/pytorch/Dockerfile.cuda > /tmp/Dockerfile.cuda``). The image's settings are those of the stages the
``sagemaker`` target is built on (``runtime-base``, then ``sagemaker``): ENV (values as written, ``${PATH}`` and
``${LD_LIBRARY_PATH}`` being the nvidia/cuda base image's), LABEL (ARGs filled in from CONFIG), EXPOSE, WORKDIR,
ENTRYPOINT, CMD, the base image, and the destination of each file COPY takes from ``scripts/`` (not from other stages).
``tests/image/test_standin.py`` checks images/standin/Containerfile against the JSON this prints. Standard library
only, plus PyYAML for CONFIG.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import yaml

#: the build: keys of CONFIG -> the Dockerfile's ARG names they set (CI's --build-arg)
ARGS = {
    "cuda_version": "CUDA_VERSION",
    "python_version": "PYTHON_VERSION",
    "torch_version": "TORCH_VERSION",
    "dlc_major_version": "DLC_MAJOR_VERSION",
    "dlc_minor_version": "DLC_MINOR_VERSION",
}


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Stage name -> [(instruction, rest of the line)] of a Dockerfile, continuations joined, comments dropped;
    a stage ``FROM x AS y`` also records its parent as ``("FROM", x)``."""
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        if op.upper() == "FROM":
            parent, _, name = re.sub(r"^--\S+\s+", "", rest).partition(" AS ")
            current = out.setdefault(name.strip(), [])
            current.append(("FROM", parent.strip()))
        else:
            current.append((op.upper(), rest.strip()))
    return out


def recipe(dockerfile: str, config: dict, target: str = "sagemaker", sources: tuple[str, ...] = ("scripts/",)) -> dict:
    """The settings of ``target``'s image (the stages it is built on, base first; ``""`` names a stage without
    ``AS``), ARGs filled in from ``config``'s ``build:`` block; ``copies`` maps the file name of each COPY source
    under one of ``sources`` to where it lands. Raises KeyError when ``target`` is not a stage."""
    found = stages(dockerfile)
    chain, name = [], target
    while name in found:
        chain.insert(0, name)
        name = found[name][0][1]
    if not chain:
        raise KeyError(target)
    args = {ARGS[k]: str(v) for k, v in config["build"].items() if k in ARGS}
    fill = lambda s: re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), s)  # noqa: E731
    base = fill(found[chain[0]][0][1])
    out = {"base": base, "stages": chain, "env": {}, "labels": {}, "expose": [], "workdir": "/", "copies": {}}
    for stage in chain:
        for op, rest in found[stage][1:]:
            if op in ("ENV", "LABEL"):
                pairs = dict(w.split("=", 1) for w in shlex.split(rest))
                out["env" if op == "ENV" else "labels"].update(
                    pairs if op == "ENV" else {k: fill(v) for k, v in pairs.items()}
                )
            elif op == "EXPOSE":
                out["expose"] += rest.split()
            elif op == "WORKDIR":
                out["workdir"] = rest
            elif op in ("ENTRYPOINT", "CMD"):
                out[op.lower()] = json.loads(rest)
            elif op == "COPY" and not rest.startswith("--from"):
                *srcs, dest = shlex.split(rest)
                for src in srcs:
                    if src.startswith(sources):
                        out["copies"][Path(src).name] = dest if not dest.endswith("/") else dest + Path(src).name
    return out


def main(dockerfile: str, config: str, commit: str) -> int:
    with open(config) as f:
        cfg = yaml.safe_load(f)
    out = recipe(Path(dockerfile).read_text(), cfg)
    out = {"source": f"aws/deep-learning-containers@{commit}", "config": cfg["build"], **out}
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]) if len(sys.argv) == 4 else (print(__doc__, file=sys.stderr) or 2))
