"""The training image's ``train`` command: SageMaker (``docker run IMAGE train``) and EC2 ``docker run``.

1. Reads the job (:mod:`trainer.sagemaker.job`): hosts, hyperparameters, data channels; maps hyperparameters to trainer
   flags; defaults ``--checkpoint-dir <root>/checkpoints``, ``--log-dir <root>/output/data/logs`` and
   ``--data-dir`` from the data channel; appends this command's own arguments (EC2: ``train --epochs 3``).
   The flags are validated here first, so a bad hyperparameter fails in seconds with exit 2.
2. Runs torchrun (``python -m trainer.launch``: ``torch.distributed.run`` without the launcher's traceback) with
   one process per GPU (one on CPU): ``--standalone`` on one host; on several, ``--nnodes <hosts> --node-rank
   <index of current_host in sorted hosts> --master-addr <first host>``. SIGTERM/SIGINT reach every rank as
   SIGTERM (all ranks save, exit 75). ``$TRAINSTACK_FAILURE_DIR`` (a temporary folder) receives each failing
   rank's record ``{exit, error, rank}`` (:mod:`trainer.failures`).
3. Exit status for SageMaker/EC2/systemd (``<root>/output/failure`` gets the reason whenever it is not 0, and the
   reason is the last line printed; a failure file left by an earlier run in the same root is removed before
   torchrun starts, :func:`clear_failure`, so a successful run leaves none):

   - 0: done; host 0 copies the ``best`` (else ``latest``) checkpoint into ``<root>/model/`` (+ model.json).
   - 2 / 3: a rank's bad config, data or checkpoint (do not retry unchanged) / non-finite loss: the status and
     the message of the lowest rank's record. 2 also for bad hyperparameters, channels or flags found here
     before torchrun starts.
   - 75: interrupted after a durable checkpoint (a new ``interrupted.json`` in the checkpoint dir, or a rank's
     record). Non-zero so SageMaker never marks an unfinished run Completed; 75 (EX_TEMPFAIL) so a restart
     policy reruns it and it resumes.
   - otherwise torchrun's status (1 when a rank failed without a record: a bug, its traceback is in the log;
     128+N when killed by signal N).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from trainer.cli import parse_train_config
from trainer.config import FIELDS, ConfigError
from trainer.engine.checkpoint_files import CheckpointDirectory
from trainer.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from trainer.failures import FAILURE_DIR_ENV, MEANINGS, read_records
from trainer.sagemaker.job import JobConfigError, JobEnv, data_dir_for, hyperparameter_flags, job_root, read_job_env

MASTER_PORT = int(os.environ.get("TRAINSTACK_MASTER_PORT", "29500"))


def processes_per_host(job: JobEnv) -> int:
    """``$TRAINSTACK_NPROC_PER_NODE``, else SM_NUM_GPUS, else visible CUDA devices; at least 1 (CPU)."""
    if os.environ.get("TRAINSTACK_NPROC_PER_NODE"):
        try:
            return max(1, int(os.environ["TRAINSTACK_NPROC_PER_NODE"]))
        except ValueError:
            raise JobConfigError(
                f"$TRAINSTACK_NPROC_PER_NODE: expected an integer, got {os.environ['TRAINSTACK_NPROC_PER_NODE']!r}"
            ) from None
    if job.num_gpus is not None:
        return max(1, job.num_gpus)
    import torch

    return max(1, torch.cuda.device_count())


def trainer_flags(job: JobEnv, extra: Sequence[str] = ()) -> list[str]:
    """Job defaults, then the hyperparameter flags, then ``extra`` (the last of a flag wins).

    The defaults (``--data-dir`` from the channels, ``--checkpoint-dir``, ``--log-dir`` under the root) are
    added only for fields that neither the hyperparameters, a ``config`` file nor ``extra`` set.

    Raises:
        JobConfigError: bad hyperparameter, invalid flags/config, or ambiguous data channels.
    """
    given = hyperparameter_flags(job.hyperparameters, str(job.root / "input/config/hyperparameters.json"))
    given += list(extra)
    cfg = _validate(given)
    defaults: list[str] = []
    if cfg.data_dir == FIELDS["data_dir"].default:
        data_dir = data_dir_for(job, cfg.train_split, cfg.val_split)
        if data_dir is not None:
            defaults += ["--data-dir", str(data_dir)]
    for name, path in (("checkpoint_dir", job.checkpoint_dir), ("log_dir", job.log_dir)):
        if getattr(cfg, name) == FIELDS[name].default:
            defaults += ["--" + name.replace("_", "-"), str(path)]
    return defaults + given


def torchrun_command(job: JobEnv, flags: Sequence[str], nproc: int, python: str = sys.executable) -> list[str]:
    """The torchrun command line for this host (:mod:`trainer.launch`, which takes torchrun's options)."""
    cmd = [python, "-m", "trainer.launch", "--nproc-per-node", str(nproc)]
    if job.nnodes == 1:
        cmd += ["--nnodes", "1", "--standalone"]
    else:
        cmd += [
            "--nnodes",
            str(job.nnodes),
            "--node-rank",
            str(job.node_rank),
            "--master-addr",
            job.master_addr,
            "--master-port",
            str(MASTER_PORT),
        ]
    return cmd + ["-m", "trainer", "train", *flags]


def _validate(flags: Sequence[str]):
    """The TrainConfig these flags give; raises JobConfigError with argparse's or the config's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_train_config(flags)
    except ConfigError as e:
        raise JobConfigError(f"config: {e}") from None
    except SystemExit as e:
        if e.code == 0:  # --help: argparse printed it to stdout
            raise
        lines = err.getvalue().strip().splitlines()
        raise JobConfigError("trainer flags: " + (lines[-1] if lines else "invalid")) from None


def export_model(checkpoint_dir: Path, model_dir: Path) -> Optional[Path]:
    """Copy the ``best`` (else ``latest``) checkpoint directory into ``model_dir`` and describe it in
    ``model.json``; returns the copy, or None when there is no checkpoint."""
    mgr = CheckpointDirectory(checkpoint_dir)  # a reader: no writer lock, no clean-up
    pointer = "best" if mgr.pointer("best") else "latest"
    name = mgr.pointer(pointer)
    if not name:
        return None
    dest = model_dir / name
    shutil.copytree(checkpoint_dir / name, dest, dirs_exist_ok=True)
    (model_dir / "model.json").write_text(
        json.dumps(
            {
                "checkpoint": name,
                "pointer": pointer,
                "files": sorted(p.name for p in dest.iterdir()),
                "load": "trainer.engine.checkpoint.CheckpointManager.load(path)",
            },
            indent=1,
        )
    )
    return dest


def fail(job: JobEnv, status: int, reason: str) -> int:
    """Print ``reason``, write it to ``<root>/output/failure`` for SageMaker (replacing any earlier run's), return
    ``status``."""
    print(f"error: train: exit {status}: {reason}", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        job.failure_file.parent.mkdir(parents=True, exist_ok=True)
        job.failure_file.write_text(reason[:1000] + "\n")
    return status


def clear_failure(job: JobEnv) -> None:
    """Remove ``<root>/output/failure`` left by an earlier run in this root (a managed-spot restart, a rerun).

    :func:`main` calls it on every host, since every host writes its own failure file (:func:`fail` has no
    host condition), once the flags are valid and just before torchrun starts. A run that then succeeds leaves
    no failure file; one that fails leaves only its own reason (:func:`fail` replaces the file, also on the
    paths that fail before this point). A file that cannot be removed (read-only mount) is named in one line
    on stderr and the run goes on.
    """
    path = job.failure_file
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        print(
            f"warning: train: cannot remove {path} left by an earlier run ({e.strerror or e}); going on",
            file=sys.stderr,
            flush=True,
        )


def run_forwarding_signals(cmd: Sequence[str], env: dict) -> int:
    """Run ``cmd`` in its own process group; SIGTERM or SIGINT to us sends SIGTERM to the whole group.

    Every rank gets the signal directly (torchrun's agent also relays it, then kills what is left after
    30 s). SIGINT is relayed as SIGTERM because the agent relays what it receives and a second SIGINT makes
    the trainer abort without saving. Returns the exit status (128 + N when killed by signal N).
    """
    procs: list[subprocess.Popen] = []
    pending: list[int] = []

    def forward(signum, _frame):
        if not procs:
            pending.append(signum)  # arrived before the child existed: relay once it does
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(procs[0].pid, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        procs.append(subprocess.Popen(list(cmd), env=env, start_new_session=True))
        if pending:
            forward(pending[0], None)
        rc = procs[0].wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def outcome(
    job: JobEnv, rc: int, checkpoint_dir: Path, marker_before: Optional[dict], records: Sequence[dict] = ()
) -> int:
    """Exit status (and failure file, model export) for a finished torchrun.

    ``records``: the ranks' failure records (:func:`trainer.failures.read_records`), lowest rank first; the
    first one that is not an interruption decides a failed run's status and message.
    """
    failed = [r for r in records if r["exit"] != EXIT_OK] if rc != EXIT_OK else []
    first = next((r for r in failed if r["exit"] != EXIT_INTERRUPTED), None)
    if first is not None:
        meaning = MEANINGS.get(first["exit"])
        return fail(job, first["exit"], first["error"] + (f" ({meaning})" if meaning else ""))
    marker = CheckpointDirectory.read_interrupted(checkpoint_dir)
    new_marker = rc != EXIT_OK and marker is not None and marker != marker_before
    if failed and not new_marker:  # interrupted, but the marker was not written: the ranks' word for it
        return fail(job, EXIT_INTERRUPTED, f"{failed[0]['error']} ({MEANINGS[EXIT_INTERRUPTED]})")
    if rc == EXIT_INTERRUPTED or new_marker:
        info = marker or {}
        return fail(
            job,
            EXIT_INTERRUPTED,
            f"interrupted ({info.get('reason', 'signal')}) after durable checkpoint "
            f"{info.get('checkpoint')} at step {info.get('global_step')}; rerun the job with the same "
            "checkpoint location to resume",
        )
    if rc != EXIT_OK:
        meaning = MEANINGS.get(rc, "a training process failed; its error is in the log above")
        return fail(job, rc, f"training exited {rc}: {meaning}")
    if job.node_rank == 0:
        try:
            dest = export_model(checkpoint_dir, job.model_dir)
        except OSError as e:
            return fail(job, 1, f"training finished but copying the checkpoint to {job.model_dir} failed: {e}")
        print(f"train: model: {dest if dest else 'no checkpoint to export'}", flush=True)
    return EXIT_OK


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``train [trainer flags...]``: run the job described by $TRAINSTACK_SM_ROOT (default /opt/ml).

    Once the flags are valid and just before torchrun starts, an earlier run's ``<root>/output/failure`` is
    removed (:func:`clear_failure`); every failure path, before or after that point, writes this run's reason.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        job = read_job_env()
    except JobConfigError as e:
        root = job_root()
        return fail(JobEnv(root=root, in_job=False, hosts=["localhost"], current_host="localhost"), EXIT_USAGE, str(e))
    try:
        flags = trainer_flags(job, argv)
        cfg = _validate(flags)
        nproc = processes_per_host(job)
    except JobConfigError as e:
        return fail(job, EXIT_USAGE, str(e))
    cmd = torchrun_command(job, flags, nproc)
    env = dict(os.environ)
    if job.nnodes > 1 and job.network_interface:
        env.setdefault("NCCL_SOCKET_IFNAME", job.network_interface)
        env.setdefault("GLOO_SOCKET_IFNAME", job.network_interface)
    checkpoint_dir = Path(cfg.checkpoint_dir)
    marker_before = CheckpointDirectory.read_interrupted(checkpoint_dir)
    clear_failure(job)
    print(f"train: host {job.current_host} ({job.node_rank + 1}/{job.nnodes}): {' '.join(cmd)}", flush=True)
    failure_dir = tempfile.mkdtemp(prefix="trainstack-failures-")
    env[FAILURE_DIR_ENV] = failure_dir
    try:
        rc = run_forwarding_signals(cmd, env)
        records = read_records(failure_dir)
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)
    return outcome(job, rc, checkpoint_dir, marker_before, records)


if __name__ == "__main__":
    sys.exit(main())
