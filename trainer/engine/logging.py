"""Metric sinks (rank 0 only): stdout ``key=value`` lines, a JSON-lines file, TensorBoard, the curves PNG,
the per-step progress display (tqdm bar on a terminal, plain lines otherwise) and the experiment trackers
(MLflow, W&B: :mod:`trainer.engine.trackers`, fed by :mod:`trainer.engine.tracking`, which receive every JSONL row as ``<kind>/<key>`` metrics).

Epoch line format (one line per epoch, parsed by SageMaker metric definitions)::

    epoch=3 step=150 lr=0.0400 train_loss=0.8123 train_top1=71.20 val_loss=0.6012 val_top1=80.40
    val_top5=98.10 ema_val_top1=79.90 images_per_s=812.3 epoch_time_s=12.41 bad_files=0 image_size=160

SageMaker ``MetricDefinitions`` regexes (documented in docs/training.md): ``val_top1=([0-9.]+)``,
``train_loss=([0-9.eE+-]+)``, ``images_per_s=([0-9.]+)`` and so on: every key is ``key=([0-9.eE+-]+)``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

from trainer.errors import ConfigError


def format_kv(values: dict) -> str:
    """``key=value`` pairs separated by spaces; floats with 4 decimals, or 6 significant digits when that would
    hide them (below 1e-3, e.g. lr=0.0001 or 1e-05, or from 1e4 up); NaN (an undefined metric, e.g. COCO's AP of
    an area range without ground truth) as ``-``; ints as ints."""
    parts = []
    for k, v in values.items():
        if isinstance(v, float) and v != v:
            parts.append(f"{k}=-")
        elif isinstance(v, float):
            plain = v != v or v == 0 or 1e-3 <= abs(v) < 1e4
            parts.append(f"{k}={v:.4f}" if plain else f"{k}={v:.6g}")
        else:
            parts.append(f"{k}={v}")
    return " ".join(parts)


class MetricsLogger:
    """Writes metrics on rank 0; every method is a no-op on other ranks.

    Files under ``log_dir``: ``metrics.jsonl`` (one JSON object per epoch and per logged step, with
    ``"kind": "epoch" | "step"``), ``tb/`` TensorBoard events, ``curves.png`` at the end. A resumed run calls
    :meth:`resume_at` so that every step appears once in both.

    Raises:
        ConfigError: ``log_dir`` cannot be created or written (rank 0).
    """

    def __init__(self, log_dir: str | Path, enabled: bool, total_steps_hint: int = 0):
        self.enabled = enabled
        self.dir = Path(log_dir)
        self.tty = sys.stderr.isatty()
        self._bar = None
        self._tb = None
        self._jsonl = None
        self._purge_step: Optional[int] = None
        self.tracking = None  # TrackingSinks after start_tracking
        # the step row of an epoch's last step, held back from the trackers until the epoch's row (see step)
        self._held: Optional[tuple[str, int, dict]] = None
        if enabled:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
            except OSError as e:
                raise ConfigError(
                    f"log_dir: cannot write {e.filename or self.dir}: {e.strerror}; choose a writable folder"
                ) from None

    def resume_at(self, global_step: int, evaluated: bool = True) -> int:
        """A run resumed after optimizer step ``global_step``: drop the rows a previous run logged beyond it
        (it was stopped or killed after its last checkpoint; the steps are trained again), so every step and
        epoch appears once in ``metrics.jsonl``; TensorBoard discards them too (``purge_step``). Unreadable
        lines (a write cut short by SIGKILL) are dropped. The file is rewritten atomically. ``evaluated=False``
        (resumed from the checkpoint written before an epoch's evaluation, which the run evaluates again) also
        drops epoch rows at ``global_step``. Returns the number of rows dropped."""
        if not self.enabled:
            return 0
        path = self.dir / "metrics.jsonl"
        self._jsonl.close()
        kept, dropped = [], 0
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                    step = int(row.get("step", 0))
                    keep = step < global_step or (step == global_step and (evaluated or row.get("kind") != "epoch"))
                except (ValueError, TypeError, AttributeError):
                    keep = False
                if keep:
                    kept.append(line if line.endswith("\n") else line + "\n")
                    if not evaluated and step == global_step and row.get("kind") == "step":
                        values = {k: v for k, v in row.items() if k not in ("kind", "step", "time")}
                        self._held = ("step", global_step, values)  # sent with the epoch row (see step)
                else:
                    dropped += 1
        if dropped:
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            with open(tmp, "w") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        self._jsonl = open(path, "a", buffering=1)
        self._purge_step = global_step + 1
        return dropped

    def start_tracking(self, trackers: list, run_ids: dict, params: dict, tags: dict) -> None:
        """Start the experiment trackers (:class:`trainer.engine.trackers.Tracker` list; rank 0), continuing the
        run ids of ``run_ids`` (tracker name -> id, from the checkpoint being resumed), and log ``params`` (the
        flat resolved config) and ``tags``. A tracker that fails is a WARNING line and is dropped."""
        if not self.enabled or not trackers:
            return
        from trainer.engine.tracking import TrackingSinks

        self.tracking = TrackingSinks(trackers, self.info)
        self.tracking.start(run_ids)
        for t in self.tracking.live:
            rid = self.tracking.run_ids[t.name]
            self.info(f"tracking: {t.name} run {rid} ({'continued' if run_ids.get(t.name) == rid else 'new'})")
        self.tracking.log_params(params)
        self.tracking.set_tags(tags)

    def tracking_ids(self) -> dict:
        """Tracker name -> run id (for the checkpoint, so that a resumed run continues them); empty when none."""
        return dict(self.tracking.run_ids) if self.tracking is not None else {}

    def _writer(self):
        """The TensorBoard writer, created on first use (after :meth:`resume_at`, with its purge step)."""
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tb"), purge_step=self._purge_step)
        return self._tb

    def info(self, msg: str) -> None:
        """Print a message line (through tqdm when a bar is active so it does not break the bar)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    # .. per-step progress ................................................................................
    def start_epoch(self, epoch: int, steps: int, initial: int = 0) -> None:
        """Open a tqdm bar for ``steps`` optimizer steps when stderr is a terminal (``epoch``: 1-based)."""
        if self.enabled and self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=steps, initial=initial, desc=f"epoch {epoch}", dynamic_ncols=True, leave=False)

    def step(self, global_step: int, values: dict, every: int, last_of_epoch: bool = False) -> None:
        """Per-step progress: bar update on a terminal; a plain ``key=value`` line every ``every`` steps
        otherwise. ``values`` is also written to JSONL/TensorBoard at those steps, and to the trackers.

        ``last_of_epoch``: the row of an epoch's last step goes to the trackers only with the epoch's row (same
        step), so that a run stopped between that step and the evaluation leaves the step unused in the trackers:
        the resumed run (:meth:`resume_at` with ``evaluated=False``) sends both then. Otherwise the earlier segment
        had used the step and the resumed one logged the validation row at it again (W&B drops a row below its
        current step)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in values.items()}, refresh=False
            )
        if global_step % every == 0:
            if self._bar is None:
                print(format_kv({"step": global_step, **values}), flush=True)
            self._record("step", global_step, values, hold=last_of_epoch)

    def end_epoch(self) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # .. per-epoch metrics ................................................................................
    def epoch(self, epoch: int, global_step: int, values: dict) -> None:
        """Print the epoch's ``key=value`` line and write it to JSONL and TensorBoard."""
        if not self.enabled:
            return
        self.info(format_kv({"epoch": epoch, "step": global_step, **values}))
        self._record("epoch", global_step, {"epoch": epoch, **values})

    def _record(self, kind: str, global_step: int, values: dict, hold: bool = False) -> None:
        row = {"kind": kind, "step": global_step, "time": time.time(), **values}
        row = {k: None if isinstance(v, float) and v != v else v for k, v in row.items()}  # NaN: JSON null
        self._jsonl.write(json.dumps(row) + "\n")
        for k, v in values.items():
            if isinstance(v, (int, float)) and k != "epoch" and math.isfinite(v):
                self._writer().add_scalar(f"{kind}/{k}", v, global_step)
        if hold:
            self._held = (kind, global_step, dict(values))
            return
        if self._held is not None:  # the epoch's row (or anything after the held one): the held row goes first
            held, self._held = self._held, None
            if self.tracking is not None:
                self.tracking.log_metrics(*held)
        if self.tracking is not None:
            self.tracking.log_metrics(kind, global_step, values)

    def close(self, tags: Optional[dict] = None, status: str = "FINISHED") -> Optional[Path]:
        """Flush files, draw ``curves.png`` from ``metrics.jsonl`` and return its path (rank 0). The trackers
        get ``tags`` (e.g. the final and best checkpoint paths), the PNG as an artifact, and are finished
        with ``status`` (:meth:`finish_tracking`)."""
        if not self.enabled:
            return None
        self.end_epoch()
        self._writer().close()
        self._jsonl.close()
        png = plot_curves(self.dir / "metrics.jsonl", self.dir / "curves.png")
        if self.tracking is not None:
            if tags:
                self.tracking.set_tags(tags)
            if png is not None:
                self.tracking.log_artifact(png)
        self.finish_tracking(status)
        return png

    def finish_tracking(self, status: str, timeout_s: Optional[float] = None) -> None:
        """Finish the trackers (after what is queued, waiting at most ``timeout_s`` seconds for it: default
        :data:`~trainer.engine.tracking.FLUSH_TIMEOUT_S`) with ``status``: FINISHED, KILLED (stopped, exit 75;
        aborted, exit 130) or FAILED (exit 2 or 3, or a crash); a no-op when none is running (rank != 0, no
        ``tracking``, already finished)."""
        held, self._held = self._held, None
        if self.tracking is not None:
            tracking, self.tracking = self.tracking, None
            if held is not None and status == "FINISHED":  # else the resumed run sends it with the epoch's row
                tracking.log_metrics(*held)
            tracking.finish(status, timeout_s=timeout_s)


_CURVE_PREFIXES = ("train_", "val_", "ema_val_")
_NOT_CURVES = ("_bad_files", "bad_files")


def plot_curves(jsonl: Path, out: Path) -> Optional[Path]:
    """PNG with loss (train/val) and accuracy (train/val/EMA val top-1, val top-5) against epoch.

    Uses only the last run's rows after a restart (rows are keyed by epoch; later rows win); unreadable
    lines are skipped. Returns None when there is no epoch row yet.
    """
    rows: dict[int, dict] = {}
    with open(jsonl) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and r.get("kind") == "epoch" and "epoch" in r:
                rows[r["epoch"]] = r
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = sorted(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    keys = sorted(
        {
            k
            for r in rows.values()
            for k, v in r.items()
            if isinstance(v, (int, float)) and k.startswith(_CURVE_PREFIXES) and not k.endswith(_NOT_CURVES)
        }
    )
    for key in keys:  # losses (every term) on the left, the task's metrics on the right
        pts = [(e, rows[e][key]) for e in epochs if key in rows[e] and math.isfinite(rows[e][key])]
        if pts:
            (ax1 if "loss" in key else ax2).plot(*zip(*pts), marker="o", label=key)
    ax1.set(xlabel="epoch", ylabel="loss (log scale)", title="loss", yscale="log")
    ax2.set(xlabel="epoch", ylabel="metric", title="validation and training metrics")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
