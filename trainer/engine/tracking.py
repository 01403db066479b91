"""Experiment-tracking sinks (rank 0 only) beside the JSONL/TensorBoard files: MLflow and Weights & Biases.

:class:`trainer.engine.logging.MetricsLogger` fans every metric row out to the sinks named by the ``tracking``
config field. One small interface, :class:`Tracker`; two implementations, :class:`MlflowTracker` and
:class:`WandbTracker`. Names: a JSONL row ``{"kind": "step", "step": 40, "loss": 0.81}`` is tracked as metric
``step/loss`` = 0.81 at step 40 (``<kind>/<JSONL key>``, the TensorBoard tag): step and epoch rows both carry
``lr`` and ``images_per_s``, so the kind keeps them apart. Non-numeric and non-finite values are not tracked.

A tracker that cannot be reached (bad URI, missing package, network) never costs the training run: the sink
prints one ``WARNING: tracking <name>: ...`` line and disables itself (:class:`TrackingSinks`).

Resume: the run id of each tracker is stored in the checkpoint (``{"tracking": {"mlflow": ID, "wandb": ID}}``)
and handed back to :meth:`Tracker.start`, so a resumed run appends to the same tracked run. Rows that the JSONL
drops on resume (:meth:`MetricsLogger.resume_at`) are logged again at the same steps: MLflow keeps both values
in the metric's history, W&B adds rows (its x-axis ``global_step`` is logged with every row).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from trainer.config.schema import TRACKERS  # noqa: F401 - the values of the tracking field, re-exported

#: MLflow's limit on a parameter value (characters); longer values are truncated with a note.
MLFLOW_PARAM_MAX = 500
#: Seconds allowed to open a TCP connection to an http(s) tracking server before the sink gives up.
CONNECT_TIMEOUT_S = 5.0


def numeric_items(values: dict) -> dict:
    """The trackable part of a metric row: int/float values (not bools) that are finite."""
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def flat_params(config: dict, limit: Optional[int] = None) -> dict:
    """Config dict -> ``{name: text}``; lists/dicts as JSON, None as ``"None"``. With ``limit`` (characters),
    a longer value is cut and ends with ``...[truncated, N chars]``."""
    out = {}
    for k, v in config.items():
        text = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
        if limit and len(text) > limit:
            note = f"...[truncated, {len(text)} chars]"
            text = text[: limit - len(note)] + note
        out[k] = text
    return out


def system_facts(repo: Optional[Path] = None) -> dict:
    """Tags describing where the run trains: ``torch`` version, ``device`` (CUDA device 0's name or ``cpu``),
    ``git_commit`` (``TRAINSTACK_COMMIT``, else ``git rev-parse HEAD`` in the repo root, when it is a git
    checkout) and ``image_tag`` (``TRAINSTACK_IMAGE_TAG``); absent facts are left out."""
    import torch

    facts = {"torch": torch.__version__}
    facts["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    commit = os.environ.get("TRAINSTACK_COMMIT")
    if not commit:
        root = repo or Path(__file__).resolve().parents[2]
        try:
            r = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=False
            )
            commit = r.stdout.strip() if r.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            commit = None
    if commit:
        facts["git_commit"] = commit
    if os.environ.get("TRAINSTACK_IMAGE_TAG"):
        facts["image_tag"] = os.environ["TRAINSTACK_IMAGE_TAG"]
    return facts


class Tracker:
    """One tracking backend. Every method may raise (the caller, :class:`TrackingSinks`, disables the sink).

    ``start(run_id)`` opens a new run (``run_id`` None) or continues ``run_id`` and returns the run's id;
    ``log_metrics(kind, step, values)`` logs ``<kind>/<key>`` at optimizer step ``step``; ``log_params``
    takes the flat config; ``set_tags`` short facts; ``log_artifact`` uploads one file; ``finish(status)``
    closes the run (``status``: ``FINISHED``, ``KILLED`` or ``FAILED``).
    """

    name = "tracker"

    def start(self, run_id: Optional[str]) -> str:
        """Open or continue the run; returns its id."""
        raise NotImplementedError

    def log_params(self, params: dict) -> None:
        """Log the flat config (name -> value)."""
        raise NotImplementedError

    def log_metrics(self, kind: str, step: int, values: dict) -> None:
        """Log one metric row (``kind``: step or epoch) at optimizer step ``step``."""
        raise NotImplementedError

    def set_tags(self, tags: dict) -> None:
        """Set short string tags (task, model, config file, system facts, checkpoint paths)."""
        raise NotImplementedError

    def log_artifact(self, path: Path, base: Optional[Path] = None) -> None:
        """Upload the file at ``path``: at the run's artifact root, or with ``base``, under its path relative to
        ``base`` (``base/predict-out/x.png`` -> ``predict-out/x.png``)."""
        raise NotImplementedError

    def finish(self, status: str = "FINISHED") -> None:
        """Close the run."""
        raise NotImplementedError

    def attach(self, run_id: str) -> None:
        """Open the existing run ``run_id`` to add artifacts to it (``predict --track``), leaving its status as it
        is where the tracker allows. Default: :meth:`start`."""
        self.start(run_id)

    def detach(self) -> None:
        """Let go of a run opened by :meth:`attach`. Default: :meth:`finish`."""
        self.finish("FINISHED")


def _check_reachable(uri: str) -> None:
    """Raise OSError when an http(s) tracking URI's host does not accept a TCP connection within
    :data:`CONNECT_TIMEOUT_S` (so an unreachable server costs seconds, not MLflow's retry minutes)."""
    u = urlparse(uri)
    if u.scheme not in ("http", "https"):
        return
    port = u.port or (443 if u.scheme == "https" else 80)
    with socket.create_connection((u.hostname, port), timeout=CONNECT_TIMEOUT_S):
        pass


class MlflowTracker(Tracker):
    """MLflow through ``MlflowClient`` (no global active run). ``uri``: any tracking URI: ``file:/path`` (a
    local file store), ``http(s)://host``, ``databricks``, or a SageMaker managed MLflow tracking server ARN
    (``arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME``, which needs the ``sagemaker-mlflow``
    plugin installed and ``sagemaker-mlflow:*`` permissions for the role). None: MLflow's default
    (``MLFLOW_TRACKING_URI`` or ``./mlruns``). ``experiment``: created when missing. Params longer than
    :data:`MLFLOW_PARAM_MAX` characters are truncated with a note; on resume, params already in the run are
    not logged again (MLflow refuses to change one).

    Raises ImportError when mlflow is not installed (from :meth:`start`).
    """

    name = "mlflow"

    def __init__(self, uri: Optional[str], experiment: str, run_name: Optional[str]):
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.client = None
        self.run_id: Optional[str] = None

    def _connect(self) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        # MLflow 3.x refuses its file store (file:/path, ./mlruns) unless opted in; a user who names one wants it
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if self.uri:
            _check_reachable(self.uri)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)

    def start(self, run_id: Optional[str]) -> str:
        self._connect()
        if run_id:
            self.client.get_run(run_id)  # raises when the run is not in this store
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return run_id
        exp = self.client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id
        return self.run_id

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params
        items = [Param(k, v) for k, v in flat_params(params, MLFLOW_PARAM_MAX).items() if k not in have]
        for i in range(0, len(items), 100):  # log_batch takes at most 100 params per call
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, kind: str, step: int, values: dict) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        metrics = [Metric(f"{kind}/{k}", v, ms, step) for k, v in numeric_items(values).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def set_tags(self, tags: dict) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: Path, base: Optional[Path] = None) -> None:
        folder = str(Path(path).parent.relative_to(base)) if base is not None else None
        self.client.log_artifact(self.run_id, str(path), None if folder == "." else folder)

    def attach(self, run_id: str) -> None:
        """The client on the existing run, its status unchanged (a finished training run stays FINISHED)."""
        self._connect()
        self.client.get_run(run_id)  # raises when the run is not in this store
        self.run_id = run_id

    def detach(self) -> None:
        """Nothing to close: MLflow's client holds no run open."""

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


class WandbTracker(Tracker):
    """Weights & Biases: ``wandb.init(project=experiment, name=run_name, id=run_id, resume="allow")``. Online
    (``WANDB_API_KEY`` or ``wandb login``) or offline (``WANDB_MODE=offline``; upload later with
    ``wandb sync DIR/wandb/offline-run-*``). Run files go under ``dir`` (the log folder). Every row also logs
    ``global_step``, the x-axis of all ``step/*`` and ``epoch/*`` metrics, so rows logged again after a resume
    are kept (W&B's own ``_step`` only grows).

    Raises ImportError when wandb is not installed (from :meth:`start`).
    """

    name = "wandb"

    def __init__(self, project: str, run_name: Optional[str], dir: Path):
        self.project, self.run_name, self.dir = project, run_name, Path(dir)
        self.run = None

    def start(self, run_id: Optional[str]) -> str:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            name=self.run_name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=str(self.dir),
            reinit="create_new",
        )
        self.run.define_metric("global_step")
        self.run.define_metric("step/*", step_metric="global_step")
        self.run.define_metric("epoch/*", step_metric="global_step")
        return self.run.id

    def log_params(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, kind: str, step: int, values: dict) -> None:
        row = {f"{kind}/{k}": v for k, v in numeric_items(values).items()}
        if row:
            self.run.log({"global_step": step, **row})

    def set_tags(self, tags: dict) -> None:
        self.run.config.update({f"tag/{k}": str(v) for k, v in tags.items()}, allow_val_change=True)
        short = [f"{k}={v}" for k, v in tags.items() if k in ("task", "model", "config") and len(f"{k}={v}") <= 64]
        self.run.tags = tuple(sorted(set(self.run.tags or ()) | set(short)))

    def log_artifact(self, path: Path, base: Optional[Path] = None) -> None:
        self.run.save(str(path), base_path=str(base if base is not None else Path(path).parent), policy="now")

    def finish(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def build_trackers(names: list, uri: Optional[str], experiment: str, run_name: Optional[str], log_dir: Path):
    """One :class:`Tracker` per name in ``names`` (values of :data:`TRACKERS`), in order."""
    make = {
        "mlflow": lambda: MlflowTracker(uri, experiment, run_name),
        "wandb": lambda: WandbTracker(experiment, run_name, log_dir),
    }
    return [make[n]() for n in names]


class TrackingSinks:
    """The enabled trackers of a run; each call goes to every live sink. The first exception of a sink prints
    ``WARNING: tracking <name>: <what>; training continues without it`` through ``warn`` and disables that
    sink (a tracker never stops training)."""

    def __init__(self, trackers: list, warn: Callable[[str], None], continues: str = "training continues"):
        self.live = list(trackers)
        self.warn = warn
        self.continues = continues
        self.run_ids: dict = {}

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for t in list(self.live):
            try:
                call(t)
            except Exception as e:  # noqa: BLE001 - any tracker failure (import, network, server) disables it
                self.live.remove(t)
                detail = " ".join(str(e).split())[:300] or type(e).__name__
                self.warn(
                    f"WARNING: tracking {t.name}: {what} failed ({type(e).__name__}: {detail}); "
                    f"{self.continues} without it"
                )

    def start(self, run_ids: dict) -> None:
        """Start every sink, continuing the run ids of ``run_ids`` (tracker name -> id, from a checkpoint)."""

        self.run_ids = {k: v for k, v in run_ids.items() if v}  # kept for the next resume if a start fails

        def go(t: Tracker) -> None:
            self.run_ids[t.name] = t.start(run_ids.get(t.name))

        self._each("start", go)

    def log_params(self, params: dict) -> None:
        """:meth:`Tracker.log_params` on every live sink."""
        self._each("log_params", lambda t: t.log_params(params))

    def log_metrics(self, kind: str, step: int, values: dict) -> None:
        """:meth:`Tracker.log_metrics` on every live sink."""
        self._each("log_metrics", lambda t: t.log_metrics(kind, step, values))

    def set_tags(self, tags: dict) -> None:
        """:meth:`Tracker.set_tags` on every live sink."""
        self._each("set_tags", lambda t: t.set_tags(tags))

    def log_artifact(self, path: Path, base: Optional[Path] = None) -> None:
        """:meth:`Tracker.log_artifact` on every live sink."""
        self._each("log_artifact", lambda t: t.log_artifact(path, base))

    def attach(self, run_ids: dict) -> None:
        """:meth:`Tracker.attach` every sink to its run in ``run_ids`` (tracker name -> id, one per sink)."""
        self.run_ids = dict(run_ids)
        self._each("attach", lambda t: t.attach(run_ids[t.name]))

    def detach(self) -> None:
        """:meth:`Tracker.detach` on every live sink; the sinks are then closed."""
        self._each("detach", lambda t: t.detach())
        self.live = []

    def finish(self, status: str = "FINISHED") -> None:
        """:meth:`Tracker.finish` on every live sink; the sinks are then closed."""
        self._each("finish", lambda t: t.finish(status))
        self.live = []
