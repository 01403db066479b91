"""The experiment-tracking backends beside the JSONL/TensorBoard files: MLflow and Weights & Biases.

One small interface, :class:`Tracker`; two implementations, :class:`MlflowTracker` and :class:`WandbTracker`,
with their connection and URI rules (:func:`resolve_mlflow_uri`, :func:`wandb_base_url`, a short reachability
check) and :func:`build_trackers`, which makes them from the ``tracking`` config fields. Names: a JSONL row
``{"kind": "step", "step": 40, "loss": 0.81}`` is tracked as metric ``step/loss`` = 0.81 at step 40
(``<kind>/<JSONL key>``, the TensorBoard tag): step and epoch rows both carry ``lr`` and ``images_per_s``, so the
kind keeps them apart. Non-numeric and non-finite values are not tracked.

Resume: the run id of each tracker is stored in the checkpoint (``{"tracking": {"mlflow": ID, "wandb": ID}}``)
and handed back to :meth:`Tracker.start`, so a resumed run appends to the same tracked run. Rows that the JSONL
drops on resume (:meth:`MetricsLogger.resume_at`) are logged again at the same steps: MLflow keeps both values
in the metric's history, W&B adds rows (its x-axis ``global_step`` is logged with every row).

Separate from :mod:`trainer.engine.tracking` (:class:`~trainer.engine.tracking.TrackingSinks`: the queue and
thread that feed these backends and disable one that fails): a backend talks to one service and may raise.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

#: MLflow's limit on a parameter value (characters); longer values are truncated with a note.
MLFLOW_PARAM_MAX = 500
#: Seconds an http(s) tracking server (MLflow's, W&B's) has to answer a first request before the sink gives up.
CONNECT_TIMEOUT_S = 5.0
#: Metrics per MLflow ``log_batch`` call (MLflow's REST limit is 1,000).
MLFLOW_BATCH_METRICS = 1000


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
    """One tracking backend. Every method may raise (the caller, :class:`~trainer.engine.tracking.TrackingSinks`,
    disables the sink).

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

    def log_rows(self, rows: list) -> None:
        """Log several metric rows, ``[(kind, step, values, wall_time_s), ...]`` in order (``wall_time_s``: when
        the row was measured, seconds since the epoch). Default: :meth:`log_metrics` each."""
        for kind, step, values, _ in rows:
            self.log_metrics(kind, step, values)

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
    """Raise OSError when an http(s) tracking server does not answer an HTTP request within
    :data:`CONNECT_TIMEOUT_S` (no TCP connection, or one that is accepted and never answered), so that an
    unreachable server costs seconds, not the tracking library's retry minutes (MLflow ~70 s, W&B ~90 s, measured).
    Any HTTP answer counts as reachable (401, 404: the library's own calls say what is wrong). Other schemes
    (file stores, plugins) are not checked."""
    import urllib.error
    import urllib.request

    u = urlparse(uri)
    if u.scheme not in ("http", "https"):
        return
    try:
        with urllib.request.urlopen(urllib.request.Request(uri, method="GET"), timeout=CONNECT_TIMEOUT_S):
            pass
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)  # the OS error behind it (refused, timed out, no such host)
        kind = type(reason) if isinstance(reason, OSError) else OSError
        raise kind(f"{u.scheme}://{u.netloc} did not answer within {CONNECT_TIMEOUT_S:g} s: {reason}") from None


def wandb_base_url() -> Optional[str]:
    """The W&B server a run would talk to (``WANDB_BASE_URL``, default ``https://api.wandb.ai``), or None when W&B
    runs without one (``WANDB_MODE`` offline, dryrun or disabled)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled"):
        return None
    return os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"


#: The MLflow store of a run that names none (no ``tracking_uri``, no ``MLFLOW_TRACKING_URI``): a file store in this
#: folder under the run's ``log_dir``.
DEFAULT_MLFLOW_DIR = "mlruns"


def resolve_mlflow_uri(uri: Optional[str], log_dir: Path, stored: Optional[str] = None) -> str:
    """The MLflow tracking URI a run logs to: ``uri`` (the ``tracking_uri`` field), else ``MLFLOW_TRACKING_URI``,
    else ``stored`` (the URI a checkpoint recorded: a resumed run or ``predict --track`` finds its run where the
    training put it), else a file store at ``<log_dir>/mlruns``. A local path or a relative ``file:`` URI is made
    an absolute ``file://`` URI (so it names the same store from any working folder); other URIs are returned as
    given.

    Why not MLflow's own default: MLflow 3.x defaults to ``sqlite:///mlflow.db`` (MLflow docs, "Backend Stores"),
    which needs SQLAlchemy; mlflow-skinny (what requirements-trainer.txt pins) does not ship it, so that default
    cannot be opened (``UnsupportedModelRegistryStoreURIException``) and a run would record nothing.
    """
    chosen = uri or os.environ.get("MLFLOW_TRACKING_URI") or stored or str(Path(log_dir) / DEFAULT_MLFLOW_DIR)
    parsed = urlparse(chosen)
    if parsed.scheme == "file" and not parsed.netloc:
        return Path(parsed.path).expanduser().resolve().as_uri()
    if not parsed.scheme or (len(parsed.scheme) == 1 and os.name == "nt"):
        return Path(chosen).expanduser().resolve().as_uri()
    return chosen


class MlflowTracker(Tracker):
    """MLflow through ``MlflowClient`` (no global active run). ``uri``: any tracking URI: ``file:/path`` (a
    local file store), ``http(s)://host``, ``databricks``, or a SageMaker managed MLflow tracking server ARN
    (``arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME``, which needs the ``sagemaker-mlflow``
    plugin installed and ``sagemaker-mlflow:*`` permissions for the role), already resolved by
    :func:`resolve_mlflow_uri` (:func:`build_trackers` does). ``experiment``: created when missing. Params longer than
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
        self.log_rows([(kind, step, values, time.time())])

    def log_rows(self, rows: list) -> None:
        """All ``rows`` in as few ``log_batch`` calls as MLflow allows (:data:`MLFLOW_BATCH_METRICS` each)."""
        from mlflow.entities import Metric

        metrics = [
            Metric(f"{kind}/{k}", v, int(t * 1000), step)
            for kind, step, values, t in rows
            for k, v in numeric_items(values).items()
        ]
        for i in range(0, len(metrics), MLFLOW_BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MLFLOW_BATCH_METRICS])

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
    ``wandb sync DIR/wandb/offline-run-*``: one folder per resumed segment, in start order, their ``_step`` ranges
    following each other). Run files go under ``dir`` (the log folder). W&B's step is the optimizer step
    (:meth:`log_metrics`); every row also logs ``global_step``, the x-axis of all ``step/*`` and ``epoch/*``
    metrics.

    Raises ImportError when wandb is not installed (from :meth:`start`).
    """

    name = "wandb"

    def __init__(self, project: str, run_name: Optional[str], dir: Path):
        self.project, self.run_name, self.dir = project, run_name, Path(dir)
        self.run = None

    def start(self, run_id: Optional[str]) -> str:
        """Check the server first (:func:`_check_reachable` of :func:`wandb_base_url`: seconds, not W&B's own
        ~90 s ``init_timeout``), then ``wandb.init``."""
        import wandb

        base = wandb_base_url()
        if base:
            _check_reachable(base)
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
        """One row at W&B step ``step`` (``run.log(..., step=step)``), the optimizer step, so a resumed run's
        history continues from the checkpoint's step instead of restarting at 0 in its new ``offline-run-*``
        folder: W&B GitHub issues #3841 and #5865 report that syncing several folders of one run id whose ``_step``
        values overlap replaces the earlier history. Rows of one step (a step row and the epoch row) become one
        history row; a row below the run's current step is dropped by W&B (online, after a resume: the steps
        trained again after the checkpoint keep their first values there; metrics.jsonl has the new ones)."""
        row = {f"{kind}/{k}": v for k, v in numeric_items(values).items()}
        if row:
            self.run.log({"global_step": step, **row}, step=step)

    def set_tags(self, tags: dict) -> None:
        self.run.config.update({f"tag/{k}": str(v) for k, v in tags.items()}, allow_val_change=True)
        short = [f"{k}={v}" for k, v in tags.items() if k in ("task", "model", "config") and len(f"{k}={v}") <= 64]
        self.run.tags = tuple(sorted(set(self.run.tags or ()) | set(short)))

    def log_artifact(self, path: Path, base: Optional[Path] = None) -> None:
        self.run.save(str(path), base_path=str(base if base is not None else Path(path).parent), policy="now")

    def finish(self, status: str = "FINISHED") -> None:
        """``wandb.Run.finish`` with exit code 0 for FINISHED, 1 for KILLED or FAILED. KILLED (stopped with a
        checkpoint: the same command resumes it) is first marked ``mark_preempting()``, so W&B shows a preempted,
        resumable run rather than a failed one (W&B docs, "Signal handling and sweep runs":
        https://docs.wandb.ai/models/sweeps/signal-handling-sweep-runs)."""
        if status == "KILLED":
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def build_trackers(
    names: list,
    uri: Optional[str],
    experiment: str,
    run_name: Optional[str],
    log_dir: Path,
    stored_uri: Optional[str] = None,
):
    """One :class:`Tracker` per name in ``names`` (values of :data:`trainer.config.schema.TRACKERS`), in order.
    MLflow's URI is :func:`resolve_mlflow_uri` of ``uri``, ``log_dir`` and ``stored_uri`` (the one a checkpoint
    recorded)."""
    make = {
        "mlflow": lambda: MlflowTracker(resolve_mlflow_uri(uri, log_dir, stored_uri), experiment, run_name),
        "wandb": lambda: WandbTracker(experiment, run_name, log_dir),
    }
    return [make[n]() for n in names]
