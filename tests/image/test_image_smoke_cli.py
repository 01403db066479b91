"""``python -m infra.cli.smoke`` (make image-smoke) refuses bad input before building anything: exit 2 and one
line naming the flag and what was expected. The smoke itself builds a 6 GiB image and is not part of make test
(docs/training-image.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.infra_helpers import REPO


def _smoke(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "infra.cli.smoke", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_a_data_folder_without_the_shared_datasets_is_named(tmp_path):
    res = _smoke("--data", str(tmp_path))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and f"--data {tmp_path}: no facemask-coco/ folder" in res.stderr


def test_a_builder_that_is_not_there_is_named(tmp_path):
    res = _smoke("--builder", str(tmp_path / "podman"), "--build-only")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and f"--builder {tmp_path / 'podman'}: not an executable" in res.stderr


def test_an_unknown_msda_value_is_refused_by_the_parser():
    res = _smoke("--msda", "fast", "--build-only")
    assert res.returncode == 2 and "--msda" in res.stderr and "'cuda', 'reference'" in res.stderr


def _fake_buildah(tmp_path, store):
    calls = tmp_path / "calls.log"
    fake = tmp_path / "buildah"
    fake.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n[ "$1" = --version ] && echo "buildah version 1.28.2 (fake)" && exit 0\n'
        f'[ "$1" = info ] && echo {store} && exit 0\nexit 1\n'
    )
    fake.chmod(0o755)
    return fake, calls


def test_too_little_disk_in_the_builders_store_is_refused_before_any_build(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    fake, calls = _fake_buildah(tmp_path, store)
    res = _smoke("--builder", str(fake), "--build-only", "--min-free-gib", "1e9")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and f"error: {store}" in res.stderr and "need about 1" in res.stderr
    assert "--min-free-gib 0" in res.stderr
    assert not any(line.split()[0] in ("bud", "build") for line in calls.read_text().splitlines())


def test_too_little_space_in_tmpdir_is_refused_before_any_build(tmp_path):
    """TMPDIR (where buildah writes the pushed layers and the smoke its local registry) is checked with the store:
    on one file system their needs add up, and the line names both."""
    store = tmp_path / "store"
    store.mkdir()
    fake, calls = _fake_buildah(tmp_path, store)
    res = _smoke("--builder", str(fake), "--build-only", "--min-free-gib", "1e9", env={"TMPDIR": str(tmp_path)})
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert f"error: {store} and {tmp_path}: " in res.stderr and "TMPDIR" in res.stderr
    assert not any(line.split()[0] in ("bud", "build") for line in calls.read_text().splitlines())


@pytest.mark.parametrize(
    "args,says",
    [
        (["--builder", "/bin/true"], "--builder /bin/true: not an OCI builder"),
        (["--ca-bundle", "/nonexistent/ca.pem"], "--ca-bundle /nonexistent/ca.pem: no such readable file"),
        (["--archs", "7.0"], "--archs '7.0': '7.0' is not an architecture the base's nvcc 13.3 and torch build"),
        (["--name", "Trainstack:x"], "--name 'Trainstack:x': not an image name"),
    ],
    ids=["builder", "ca-bundle", "archs", "name"],
)
def test_bad_inputs_are_refused_before_building_with_one_line(args, says, tmp_path):
    """Given a fake buildah (a real one would build if the refusal went missing: it did, with a missing
    --ca-bundle, an unsupported arch and /bin/true taken for docker)."""
    store = tmp_path / "store"
    store.mkdir()
    fake, calls = _fake_buildah(tmp_path, store)
    builder = [] if "--builder" in args else ["--builder", str(fake)]
    res = _smoke(*args, *builder, "--build-only", "--min-free-gib", "0", "--base-image", "scratch")
    assert res.returncode == 2 and res.stdout == "" and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"error: {says}"), res.stderr
    assert not calls.exists() or not any(ln.split()[0] in ("bud", "from") for ln in calls.read_text().splitlines())


def test_the_make_targets_build_distinct_local_names():
    """make image, image-cpu and image-smoke tagged one name, so each replaced the others' image."""
    names = {}
    for target in ("image", "image-cpu", "image-smoke"):
        out = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True).stdout
        line = next(ln for ln in out.splitlines() if "infra.cli.smoke" in ln)
        names[target] = line.split("--name ")[1].split()[0] if "--name " in line else "trainstack-training-smoke"
    assert len(set(names.values())) == 3, names


def test_buildah_containers_start_through_the_images_entrypoint(tmp_path):
    """``docker run IMAGE train --x`` runs ENTRYPOINT + ``train --x``; ``buildah run`` applies no entrypoint, so the
    builder reads it from the image and puts it in front (the smoke then tests the entrypoint SageMaker runs)."""
    from infra.cli import builder as oci

    calls = tmp_path / "calls.jsonl"
    fake = tmp_path / "buildah"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\nopen({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "entry = ['/opt/trainstack/bin/entrypoint']\n"
        "if sys.argv[1] == 'inspect': print(json.dumps({'OCIv1': {'config': {'Entrypoint': entry}}}))\n"
    )
    fake.chmod(0o755)
    c = oci.Builder("buildah", str(fake)).start("trainstack-training:t", ["train", "--x"], env={"A": "1"})
    assert c.wait(timeout=30) == 0
    run = next(argv for argv in map(json.loads, calls.read_text().splitlines()) if argv[0] == "run")
    assert run[run.index("--") + 1 :] == ["/opt/trainstack/bin/entrypoint", "train", "--x"]
    assert ["--env", "A=1"] == run[run.index("--env") : run.index("--env") + 2]
