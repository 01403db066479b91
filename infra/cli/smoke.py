"""``make image-smoke``: build images/training/Dockerfile with the OCI builder this machine has and run every task
inside the built image. ``python -m infra.cli.smoke --help``.

Steps (each prints one ``image-smoke:`` line; the first failure ends the run with exit 1 and its output):

1. The base: ``--base-image`` when given (e.g. the real DLC, pulled by the builder), else the stand-in of
   ``images/standin/`` (built when missing: a Debian trixie rootfs by ``mmdebstrap``, imported, then its
   Containerfile; :mod:`infra.cli.smoke_standin`). The stand-in is for offline builds only and is never pushed.
2. The image: the Dockerfile with push-image's build arguments (infra/cli/image.py ``build_args``: the op compiled
   in the build for ``--archs``, default the Dockerfile's, and the OCI labels), tagged
   ``<--name>:<git tag>`` (default ``trainstack-training-smoke``; push-image's tag): the image push-image builds
   for that commit.
3. In the image, each command started as ``docker run IMAGE ...`` starts it (through the image's ENTRYPOINT):
   the base as the build left it (nvcc's version, ``pip check``, the base's packages, our ``train`` first on
   PATH; ``pip freeze`` against images/training/requirements-lock.txt); ``python -m trainer.check_install``; the op; ``train`` on the embedded digits for a few steps with the
   checkpoint in a mounted folder; SIGTERM during training -> exit 75, and a rerun that resumes and finishes;
   the SageMaker contract (``/opt/ml`` mounted: hyperparameters.json, checkpoints, model, and the failure file
   of a bad hyperparameter, exit 2); a 2-host SageMaker job (two containers as algo-1 and algo-2 on loopback,
   gloo) to the end, then one stopped by a SIGTERM to algo-2 (both exit 75) and resumed; one short step of
   detection (facemask-coco), segmentation (rid-roofs) and video (clips derived in the image from video-clips)
   on ``--data`` mounted read-only at /data.
4. The tested image pushed to a registry on 127.0.0.1 (infra/cli/registry.py): the digest it stores is the one
   push-image prints for the same commit, base and architectures.
5. The last line: ``image-smoke: passed <image> <digest> ...`` with the build time and the image size, and a
   JSON record under ``runs/image-smoke/`` (what docs/training-image.md tabulates). ``--build-only`` builds and
   says ``built ... (nothing checked)``.

Build-time bind mounts: a CA bundle (``--ca-bundle``, default this machine's) over the file the base's OpenSSL
reads (infra/cli/builder.py ``ca_mounts``), so pip inside the build trusts a TLS-inspecting proxy; nothing of it
stays in the image. Exit 2, before anything is built: a bad flag, a missing data folder or CA file, an
architecture the base cannot build, a builder that is not one, too little disk (infra/cli/image_inputs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from infra.cli import builder as oci
from infra.cli import image_inputs
from infra.cli.image import DOCKERFILE, build_args, default_archs, git_tag
from infra.cli.registry import local_registry
from infra.cli.session import CliError
from infra.cli.smoke_checks import check_labels, check_lock
from infra.cli.smoke_hosts import SmokeFailure, say, two_host_job
from infra.cli.smoke_standin import STANDIN, ensure_standin

REPO = Path(__file__).resolve().parents[2]


# The compiled extension loads, and the custom operator is registered and runs (CPU: the reference kernel)
OP_CHECK = """
import torch
from trainer.ops import msda
from trainer.ops.msda import library
ext = msda.load_extension()
assert ext is not None, msda.extension_error()
value, shapes, start = torch.rand(1, 6, 2, 4), torch.tensor([[2, 3]]), torch.tensor([0])
loc, attn = torch.rand(1, 5, 2, 1, 2, 2), torch.rand(1, 5, 2, 1, 2)
out = torch.ops.trainstack.ms_deform_attn(value, shapes, start, loc, attn, 64, [2, 3])
ref = msda.ms_deform_attn_core_pytorch(value, shapes, loc, attn)
assert out.shape == (1, 5, 8) and torch.allclose(out, ref, atol=1e-6), (out.shape, (out - ref).abs().max())
print("trainstack::ms_deform_attn matches the reference; extension", ext.__file__)
"""


# What the base must still be after our build (the DLC's set, as the stand-in reproduces it): a consistent pip set,
# the DLC's SageMaker packages, MLflow's three halves at one version, our `train` ahead of sagemaker-training's
BASE_CHECK = """
import importlib.metadata as md, shutil, subprocess, sys
bad = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
assert bad.returncode == 0, "pip check: " + bad.stdout + bad.stderr
versions = {n: md.version(n) for n in ("torch", "mlflow", "mlflow-skinny", "mlflow-tracing", "sagemaker",
    "sagemaker-training", "onnx", "onnxruntime", "ninja", "numpy")}
assert len({versions[n] for n in ("mlflow", "mlflow-skinny", "mlflow-tracing")}) == 1, versions
assert shutil.which("train") == "/opt/trainstack/bin/train", shutil.which("train")
print("pip check: no broken requirements;", ", ".join(f"{n} {v}" for n, v in versions.items()))
"""


def check_disk(b: oci.Builder, min_free_gib: float) -> None:
    """Refuses to start when the builder's store, the folder buildah/podman write a pushed image's compressed
    layers to (``$TMPDIR``, else /var/tmp) or the smoke's own temporary folder (Python's ``$TMPDIR``, else /tmp:
    the local registry receives the push there) has too little free space. The store needs ``min_free_gib``
    GiB (a cold smoke writes the stand-in, 5.8 GB, the image, 6.6 GB, and the copies a build commits: 12 GB in
    buildah's store after one cold run, 2026-11-27), half with the stand-in already stored; each temporary
    folder a quarter of it (the pushed image is 3.3 GB compressed). Folders on one file system add up. Raises
    CliError naming the folders, what is free and what is needed."""
    root = b.storage_root()
    need = min_free_gib / 2 if b.exists(STANDIN) else min_free_gib
    needs = {root: need}
    for folder in (image_inputs.big_files_tmpdir(), image_inputs.smoke_tmpdir()):
        needs[folder] = needs.get(folder, 0.0) + min_free_gib / 4
    image_inputs.check_free_space(needs)


class Smoke:
    """The in-image checks of one built ``image``; ``work`` is a host folder mounted read-write at /work."""

    def __init__(self, b: oci.Builder, image: str, work: Path, data: Path):
        self.b, self.image, self.work, self.data = b, image, work, data

    def run(
        self,
        step: str,
        argv: list[str],
        *,
        expect: int = 0,
        mounts: tuple[oci.Mount, ...] = (),
        signal_after: Optional[str] = None,
        timeout: float = 900,
    ) -> str:
        """Runs ``argv`` in the image with /work (rw) and /data (ro) mounted and one process per node; with
        ``signal_after``, sends SIGTERM once a line starts with it. Returns the output; raises SmokeFailure
        unless the exit status is ``expect``."""
        log = self.work / f"{re.sub(r'[^a-z0-9]+', '-', step.lower())}.log"
        base = (oci.Mount(str(self.work), "/work", rw=True), oci.Mount(str(self.data), "/data"))
        env = {"TRAINSTACK_NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "2"}
        start = time.monotonic()
        with open(log, "w") as out:
            c = self.b.start(self.image, argv, [*base, *mounts], env, stdout=subprocess.PIPE)
            signalled = False
            try:
                for line in c.proc.stdout:
                    out.write(line)
                    if signal_after and not signalled and line.startswith(signal_after):
                        c.signal()
                        signalled = True
                    if time.monotonic() - start > timeout:
                        c.signal(9)
                rc = c.wait(timeout=60)
            finally:
                c.stop()  # a run given up on (an error, Ctrl-C) leaves no container behind
        text = log.read_text()
        if rc != expect or (signal_after and not signalled):
            why = "never saw " + repr(signal_after) if signal_after and not signalled else f"exit {rc}"
            raise SmokeFailure(f"{step}: {why}, expected exit {expect} ({log}):\n{text[-4000:]}")
        say(f"{step}: exit {rc} as expected ({time.monotonic() - start:.0f} s)")
        return text

    def write(self, name: str, content: dict) -> str:
        """A config file in /work (JSON is YAML); returns its path inside the container."""
        (self.work / name).write_text(json.dumps(content, indent=1))
        return f"/work/{name}"

    def all(self, only: str = "all") -> None:
        """Every check of the module docstring's step 3, in order (``only``: one group: install, digits,
        sagemaker or tasks)."""
        if only == "sagemaker":
            return self._sagemaker()
        if only == "hosts":
            return two_host_job(self)
        if only == "tasks":
            return self._tasks()
        nvcc = self.run("nvcc in the base", ["nvcc", "--version"])
        say(f"nvcc: {nvcc.strip().splitlines()[-2] if nvcc.strip() else '?'}")
        self.run("pip check and the base's packages", ["python3", "-c", BASE_CHECK])
        check_lock(self.run("pip freeze", ["python3", "-m", "pip", "freeze"]))
        self.run("check_install", ["python3", "-m", "trainer.check_install"])
        self.run("op extension and custom operator", ["python3", "-c", OP_CHECK])
        digits = [
            "train", "--config", "configs/digits.yaml", "--device", "cpu", "--model", "resnet18",
            "--image-size", "32", "--batch-size", "32", "--num-workers", "0", "--log-every-steps", "1", "--warmup-epochs", "0",
        ]  # fmt: skip
        if only == "install":
            return None
        ck = ["--checkpoint-dir", "/work/digits/ckpt", "--log-dir", "/work/digits/logs"]
        self.run("digits train", [*digits, *ck, "--epochs", "1", "--max-steps-per-epoch", "4"])
        if not (self.work / "digits" / "ckpt" / "latest").is_file():
            raise SmokeFailure("digits train: no checkpoint in the mounted folder /work/digits/ckpt")

        ck = ["--checkpoint-dir", "/work/stop/ckpt", "--log-dir", "/work/stop/logs"]
        long = [*digits, *ck, "--epochs", "1", "--max-steps-per-epoch", "12"]  # the stop writes the checkpoint
        self.run("SIGTERM during training", long, expect=75, signal_after="step=")
        marker = json.loads((self.work / "stop" / "ckpt" / "interrupted.json").read_text())
        out = self.run("rerun after SIGTERM", long)
        if "checkpoint: resuming from" not in out:
            raise SmokeFailure(f"rerun after SIGTERM: no 'checkpoint: resuming from' line:\n{out[-2000:]}")
        say(f"rerun resumed from {marker['checkpoint']} (step {marker['global_step']}) and finished")
        if only == "digits":
            return None

        self._sagemaker()
        two_host_job(self)
        self._tasks()

    def _sagemaker(self) -> None:
        root = self.work / "opt_ml"
        (root / "input" / "config").mkdir(parents=True)
        hps = {"data_dir": '"builtin:digits"', "epochs": "1", "max_steps_per_epoch": "3", "device": '"cpu"'}
        hps |= {"model": '"resnet18"', "image_size": "32", "batch_size": "32", "num_workers": "0", "warmup_epochs": "0"}
        (root / "input" / "config" / "hyperparameters.json").write_text(json.dumps(hps))
        sm = (oci.Mount(str(root), "/opt/ml", rw=True),)
        self.run("SageMaker job (hyperparameters.json)", ["train"], mounts=sm)
        model = json.loads((root / "model" / "model.json").read_text())
        for path in (root / "model" / model["checkpoint"] / "state.pt", root / "checkpoints" / "latest"):
            if not path.is_file():
                raise SmokeFailure(f"SageMaker job: {path} missing after exit 0")
        (root / "input" / "config" / "hyperparameters.json").write_text(json.dumps({"learning_rate": "0.1"}))
        self.run("SageMaker bad hyperparameter", ["train"], mounts=sm, expect=2)
        failure = (root / "output" / "failure").read_text()
        if "unknown hyperparameter 'learning_rate'" not in failure:
            raise SmokeFailure(f"SageMaker bad hyperparameter: output/failure says {failure!r}")
        say("SageMaker failure file names the key")

    def _tasks(self) -> None:
        short = {"epochs": 1, "max_steps_per_epoch": 1, "device": "cpu", "num_workers": 0, "precision": "32"}
        short |= {"channels_last": False}
        facemask = json.loads((self.data / "facemask-coco" / "annotations" / "custom_train.json").read_text())
        images = facemask["images"][:4]
        ids = {i["id"] for i in images}
        subset = {"images": images, "categories": facemask["categories"]}
        subset["annotations"] = [a for a in facemask["annotations"] if a["image_id"] in ids]
        (self.work / "facemask" / "annotations").mkdir(parents=True)
        for split in ("train", "val"):  # 4 images, both splits: one step and a short evaluation
            (self.work / "facemask" / "annotations" / f"instances_{split}.json").write_text(json.dumps(subset))
        det = {"task": "detection", "data_dir": "/work/facemask", "coco_images": "/data/facemask-coco/train2017"}
        det |= dict(model="resnet18", min_scale=64, max_scale=64, max_size=96, eval_size=64, num_queries=30)
        det |= dict(num_select=30, dn_number=10, hidden_dim=32, dim_feedforward=64, enc_layers=1, dec_layers=2)
        det |= dict(nheads=4, optimizer="adamw", lr=1e-4, batch_size=2)
        seg = {"task": "segmentation", "data_dir": "/data/rid-roofs", "mask_suffix": "_reviewed", "image_size": 64}
        seg |= {"model": "unet", "encoder": "resnet18", "val_fraction": 0.25, "max_samples": 8, "batch_size": 2}
        seg["classes"] = [
            "pvmodule",
            "dormer",
            "window",
            "ladder",
            "chimney",
            "shadow",
            "tree",
            "unknown",
            "background",
        ]
        for name, cfg in (("detection", det), ("segmentation", seg)):
            path = self.write(f"{name}.yaml", {**cfg, **short})
            self.run(f"{name} step", ["train", "--config", path, "--checkpoint-dir", f"/work/{name}/ckpt"])
        derive = (
            "import glob; from trainer.data.formats.video.derived import write_clip_sets; "
            "print(write_clip_sets(sorted(glob.glob('/data/video-clips/*')), '/work/clips', size=32))"
        )
        self.run("video clips decoded in the image", ["python3", "-c", derive])
        vid = {"task": "video", "model": "frame_transformer", "video_format": "arrays"}
        vid |= {"data_dir": "/work/clips/clip-source", "num_frames": 8, "image_size": 32, "batch_size": 4}
        vid |= dict(temporal_dim=64, temporal_layers=2, temporal_heads=4, temporal_mlp_dim=128)
        path = self.write("video.yaml", {**vid, **short})
        self.run("video step", ["train", "--config", path, "--checkpoint-dir", "/work/video/ckpt"])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.cli.smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--builder", help="docker, podman or buildah binary (default: the first found)")
    p.add_argument("--base-image", help="BASE_IMAGE (default: the stand-in of images/standin, built when missing)")
    p.add_argument("--msda", choices=("cuda", "reference"), default="cuda", help="MSDA build argument")
    p.add_argument(
        "--archs",
        default=default_archs(REPO),
        help="TORCH_CUDA_ARCH_LIST of the op (default: the Dockerfile's, push-image's)",
    )
    data = os.environ.get("TRAINSTACK_DATA", str(REPO.parent / "shared" / "data"))
    p.add_argument(
        "--data", default=data, help="datasets, mounted read-only (default: TRAINSTACK_DATA, ../shared/data)"
    )
    p.add_argument(
        "--ca-bundle",
        help="CA file mounted over the base's CA bundle for the build's RUN steps (podman/buildah; default: this "
        "machine's OpenSSL bundle, when there is one)",
    )
    p.add_argument(
        "--name",
        default="trainstack-training-smoke",
        help="local image name, tagged with the git tag (make image and image-cpu pass their own)",
    )
    p.add_argument(
        "--min-free-gib", type=float, default=20.0, help="refuse to start below this free disk in the builder's store"
    )
    p.add_argument("--build-only", action="store_true", help="build and print the image line: nothing is checked")
    p.add_argument(
        "--only", choices=("all", "install", "digits", "sagemaker", "hosts", "tasks"), default="all", help="checks"
    )
    args = p.parse_args(argv)
    data = Path(args.data).resolve()
    for sub in ("facemask-coco", "rid-roofs", "video-clips"):
        if not args.build_only and not (data / sub).is_dir():
            print(
                f"error: --data {data}: no {sub}/ folder; expected ../shared/data with the shared datasets",
                file=sys.stderr,
            )
            return 2
    try:
        image_inputs.check_name(args.name)
        image_inputs.check_archs(args.archs)
        ca_bundle = image_inputs.check_ca_bundle(args.ca_bundle) if args.ca_bundle else host_ca_bundle()
        b = oci.find(args.builder)
        check_disk(b, args.min_free_gib)
        image = f"{args.name}:{image_inputs.check_tag(git_tag(REPO))}"
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        # a docker engine's containers write root-owned files into the mounted folder: never fail on its removal
        with tempfile.TemporaryDirectory(prefix="image-smoke-", ignore_cleanup_errors=True) as tmp:
            work = Path(tmp)
            started = time.monotonic()
            base = args.base_image or ensure_standin(b, ca_bundle, work)
            base_s = time.monotonic() - started
            say(f"building {image} FROM {base} with {b.kind} (MSDA={args.msda}, TORCH_CUDA_ARCH_LIST={args.archs})")
            started = time.monotonic()
            bargs = build_args(b, REPO, base, args.archs, args.msda)
            # docker: no mounts, the machine must reach PyPI without them
            b.build(REPO, DOCKERFILE, image, bargs, oci.ca_mounts(b, ca_bundle, base))
            build_s = time.monotonic() - started
            check_labels(b, image, bargs)
            digest, size = b.image_digest(image), b.image_size(image)
            say(f"built in {build_s:.0f} s (base {base_s:.0f} s), {size / 2**30:.2f} GiB, local {digest}")
            checks_s = push_s = None
            if not args.build_only:
                started = time.monotonic()
                Smoke(b, image, work, data).all(args.only)
                checks_s = time.monotonic() - started
                started = time.monotonic()
                with local_registry(work / "registry") as registry:
                    digest = b.push(image, tls_verify=False, dest=f"{registry}/{image}")
                push_s = time.monotonic() - started
                say(f"pushed to a registry on 127.0.0.1 in {push_s:.0f} s: {digest} (push-image's digest)")
    except (CliError, SmokeFailure) as e:
        print(f"image-smoke: FAILED: {e}", file=sys.stderr)
        return 1
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": _cpu_model(),
        "builder": b.kind,
        "image": image,
        "digest": digest,
        "base": base,
        "base_s": round(base_s, 1),
        "build_s": round(build_s, 1),
        "checks_s": None if checks_s is None else round(checks_s, 1),
        "push_s": None if push_s is None else round(push_s, 1),
        "pushed_digest": not args.build_only,
        "build_args": bargs,
        "size_bytes": size,
        "archs": args.archs,
    }
    out = REPO / "runs" / "image-smoke"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(record, indent=1) + "\n")
    if args.build_only:
        print(f"image-smoke: built {image} {digest} (build {build_s:.0f} s, base {base_s:.0f} s, "
              f"{size / 2**30:.2f} GiB; nothing checked: --build-only)")  # fmt: skip
        return 0
    print(f"image-smoke: passed {image} {digest} (build {build_s:.0f} s, base {base_s:.0f} s, checks "
          f"{checks_s:.0f} s, push {push_s:.0f} s, {size / 2**30:.2f} GiB)")  # fmt: skip
    return 0


def host_ca_bundle() -> Optional[str]:
    """This machine's OpenSSL CA file (``ssl.get_default_verify_paths``: Debian's /usr/lib/ssl/cert.pem, Amazon
    Linux's /etc/pki/tls/cert.pem), resolved, or None when it has none."""
    cafile = ssl.get_default_verify_paths().openssl_cafile
    return str(Path(cafile).resolve()) if cafile and Path(cafile).is_file() else None


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if os.path.exists("/proc/cpuinfo") else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} vCPUs"
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
