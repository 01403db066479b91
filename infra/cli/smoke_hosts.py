"""The image smoke's 2-host SageMaker job (``make image-smoke``, ``python -m infra.cli.smoke --only hosts``): two
containers of the image as SageMaker hosts algo-1 and algo-2 on this machine's loopback, started as SageMaker
starts them (``train`` through the image's ENTRYPOINT, ``/opt/ml/input/config/resourceconfig.json`` per host).
SageMaker's contract: AWS, "How Amazon SageMaker Provides Training Information" (resourceconfig.json:
``current_host``, ``hosts``, ``network_interface_name``) and "Use checkpoints in Amazon SageMaker" (the job's
checkpoint S3 URI restored to ``/opt/ml/checkpoints`` on every host). Also the smoke's shared basics: its failure
type and its output line."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional, Protocol

from infra.cli import builder as oci


class SmokeFailure(Exception):
    """A step of the smoke test failed; the message names the step and ends with the command's output."""


class ImageUnderTest(Protocol):
    """What the checks need of infra.cli.smoke.Smoke: the builder, the built image, a host folder mounted at /work."""

    b: oci.Builder
    image: str
    work: Path


def say(msg: str) -> None:
    """One ``image-smoke:`` line on stdout."""
    print(f"image-smoke: {msg}", flush=True)


def run_hosts(
    smoke: ImageUnderTest,
    step: str,
    roots: dict[str, Path],
    mounts: tuple[oci.Mount, ...],
    env: dict[str, str],
    *,
    expect: int = 0,
    signal_host: Optional[str] = None,
    signal_after: Optional[str] = None,
    timeout: float = 900,
) -> dict[str, str]:
    """Runs ``train`` in one container per host of ``roots`` (host name -> its /opt/ml folder) at once, each
    with ``mounts`` and ``env``; with ``signal_host``, sends it SIGTERM once the first host prints a line
    starting with ``signal_after``. Returns each host's output; raises SmokeFailure unless every host exits
    ``expect``."""
    start = time.monotonic()
    first = next(iter(roots))
    seen = threading.Event()
    running, logs, threads = {}, {}, []
    for host, root in roots.items():
        m = (oci.Mount(str(root), "/opt/ml", rw=True), *mounts)
        names = {h: "127.0.0.1" for h in roots}  # every host on loopback
        running[host] = smoke.b.start(smoke.image, ["train"], m, env, stdout=subprocess.PIPE, hosts=names)
        logs[host] = smoke.work / f"{re.sub(r'[^a-z0-9]+', '-', step.lower())}-{host}.log"

    def pump(host: str) -> None:
        with open(logs[host], "w") as out:
            for line in running[host].proc.stdout:
                out.write(line)
                out.flush()
                if host == first and signal_after and line.startswith(signal_after):
                    seen.set()

    for host in roots:
        threads.append(threading.Thread(target=pump, args=(host,), daemon=True))
        threads[-1].start()
    signalled = False
    while any(c.proc.poll() is None for c in running.values()) and time.monotonic() - start < timeout:
        if signal_host and seen.is_set() and not signalled:
            running[signal_host].signal()
            signalled = True
        time.sleep(0.2)
    for c in running.values():
        if c.proc.poll() is None:
            c.signal(9)
    codes = {host: c.wait(timeout=60) for host, c in running.items()}
    for t in threads:
        t.join(10)
    texts = {host: logs[host].read_text() for host in roots}
    if any(rc != expect for rc in codes.values()) or (signal_host and not signalled):
        why = f"never saw {signal_after!r} on {first}" if signal_host and not signalled else f"exits {codes}"
        tails = "\n".join(f"--- {h} ({logs[h]}):\n{t[-2500:]}" for h, t in texts.items())
        raise SmokeFailure(f"{step}: {why}, expected exit {expect} on every host:\n{tails}")
    say(f"{step}: exits {codes} as expected ({time.monotonic() - start:.0f} s)")
    return texts


def two_host_job(smoke: ImageUnderTest) -> None:
    """A 2-host SageMaker job of the image: two containers as algo-1 and algo-2 (resourceconfig.json; the names
    on 127.0.0.1 in each container's /etc/hosts; network_interface_name lo), one rank each, gloo, one shared
    checkpoint folder at /opt/ml/checkpoints (what SageMaker restores to every host from the job's checkpoint
    S3 URI). Runs one job to the end, then one stopped by SIGTERM to algo-2 (both hosts exit 75, host 0 writes
    interrupted.json) and its rerun, which resumes and finishes. Each host's gethostname() must be its own
    SageMaker name: the image's entrypoint keeps the base's hostname fix."""
    names = ["algo-1", "algo-2"]
    top = smoke.work / "two-hosts"
    top.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"TRAINSTACK_NPROC_PER_NODE": "1", "TRAINSTACK_MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    hps = {"data_dir": '"builtin:digits"', "epochs": "1", "device": '"cpu"', "model": '"resnet18"'}
    hps |= {"image_size": "32", "batch_size": "32", "num_workers": "0", "warmup_epochs": "0"}
    hps |= {"log_every_steps": "1"}

    def job(name: str, steps: int) -> tuple[dict[str, Path], tuple[oci.Mount, ...]]:
        ckpt = top / name / "checkpoints"
        ckpt.mkdir(parents=True)
        roots = {}
        for host in names:
            root = roots[host] = top / name / host
            (root / "input" / "config").mkdir(parents=True)
            rc = {"current_host": host, "hosts": names, "network_interface_name": "lo"}
            (root / "input" / "config" / "resourceconfig.json").write_text(json.dumps(rc))
            config = {**hps, "max_steps_per_epoch": str(steps)}
            (root / "input" / "config" / "hyperparameters.json").write_text(json.dumps(config))
        mounts = (oci.Mount(str(ckpt), "/opt/ml/checkpoints", rw=True),)
        return roots, mounts

    roots, mounts = job("to-the-end", 4)
    out = run_hosts(smoke, "2-host SageMaker job", roots, mounts, env)
    for host in names:
        if f"gethostname() -> {host} " not in out[host]:
            raise SmokeFailure(
                f"2-host job: {host}'s entrypoint did not make gethostname() {host}:\n{out[host][-1500:]}"
            )
    if not (roots["algo-1"] / "model" / "model.json").is_file():
        raise SmokeFailure("2-host job: host 0 exported no model (model/model.json)")
    roots, mounts = job("stopped", 60)
    run_hosts(smoke, "2-host job, SIGTERM to algo-2", roots, mounts, env, expect=75, signal_host="algo-2",
               signal_after="step=")  # fmt: skip
    marker = json.loads((top / "stopped" / "checkpoints" / "interrupted.json").read_text())
    out = run_hosts(smoke, "2-host job rerun", roots, mounts, env)
    if "checkpoint: resuming from" not in out["algo-1"]:
        raise SmokeFailure(f"2-host rerun: no 'checkpoint: resuming from' line:\n{out['algo-1'][-2000:]}")
    say(f"2-host rerun resumed from {marker['checkpoint']} (step {marker['global_step']}) and finished")
