"""The tracking sinks deliver off the training thread (:class:`trainer.engine.tracking.TrackingSinks`): a tracker
that is slow or hangs never holds a training step; items arrive in order, consecutive metric rows in one batch;
``finish`` drains the queue, or gives up after its timeout with a WARNING line; a sink that fails is dropped while
the others get everything. The trackers here are small recording doubles (their network is what is replaced); the
real MLflow and W&B go through the same class in tests/engine/test_tracking.py."""

from __future__ import annotations

import threading

import pytest

from trainer.engine.trackers import MlflowTracker, Tracker
from trainer.engine.tracking import TrackingSinks


class Recorder(Tracker):
    """Records every call; ``gate`` (an Event) holds ``log_rows`` until it is set."""

    def __init__(self, name: str = "rec", gate: threading.Event | None = None, fail_on: str | None = None):
        self.name, self.gate, self.fail_on = name, gate, fail_on
        self.calls: list = []
        self.batches: list[int] = []
        self.entered = threading.Event()

    def start(self, run_id):
        self.calls.append(("start", run_id))
        return run_id or "run-1"

    def log_params(self, params):
        self.calls.append(("params", dict(params)))

    def log_rows(self, rows):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        if self.fail_on == "log_metrics":
            raise ConnectionError("server went away")
        self.batches.append(len(rows))
        self.calls += [("row", kind, step, values) for kind, step, values, _ in rows]

    def set_tags(self, tags):
        self.calls.append(("tags", dict(tags)))

    def log_artifact(self, path, base=None):
        self.calls.append(("artifact", str(path)))

    def finish(self, status="FINISHED"):
        self.calls.append(("finish", status))


def test_a_blocked_tracker_does_not_hold_the_caller_and_gets_every_item_in_order():
    gate = threading.Event()
    rec = Recorder(gate=gate)
    warnings: list[str] = []
    sinks = TrackingSinks([rec], warnings.append)
    sinks.start({})
    sinks.log_params({"lr": 0.1})
    values = {"loss": 1.0}
    sinks.log_metrics("step", 1, values)
    assert rec.entered.wait(10)  # the thread is inside the tracker, blocked on the gate
    for step in range(2, 6):  # the caller goes on while the tracker is blocked
        values["loss"] = 1.0 / step  # the caller reuses its dict: the queued rows are copies
        sinks.log_metrics("step", step, values)
    sinks.set_tags({"checkpoint_final": "ck/step-5"})
    sinks.log_metrics("epoch", 5, {"val_top1": 0.5})
    assert [c[0] for c in rec.calls] == ["start", "params"]  # nothing past the blocked row has arrived
    gate.set()
    sinks.finish("FINISHED")
    assert rec.calls == [
        ("start", None),
        ("params", {"lr": 0.1}),
        ("row", "step", 1, {"loss": 1.0}),
        *[("row", "step", s, {"loss": 1.0 / s}) for s in range(2, 6)],
        ("tags", {"checkpoint_final": "ck/step-5"}),
        ("row", "epoch", 5, {"val_top1": 0.5}),
        ("finish", "FINISHED"),
    ]
    assert rec.batches == [1, 4, 1]  # the 4 rows queued behind the blocked one went in one batch
    assert warnings == [] and sinks.live == []


def test_a_failing_sink_is_dropped_with_one_warning_and_the_others_get_everything():
    bad, good = Recorder("bad", fail_on="log_metrics"), Recorder("good")
    warnings: list[str] = []
    sinks = TrackingSinks([bad, good], warnings.append)
    sinks.start({"bad": "r-bad", "good": "r-good"})
    for step in range(1, 4):
        sinks.log_metrics("step", step, {"loss": float(step)})
    sinks.finish("KILLED")
    assert [c for c in good.calls if c[0] == "row"] == [("row", "step", s, {"loss": float(s)}) for s in (1, 2, 3)]
    assert good.calls[-1] == ("finish", "KILLED") and bad.calls[-1][0] == "start"
    assert len(warnings) == 1
    assert warnings[0].startswith("WARNING: tracking bad: log_metrics failed (ConnectionError: server went away)")
    assert sinks.run_ids == {"bad": "r-bad", "good": "r-good"}  # kept for the checkpoint


@pytest.mark.parametrize("timeout_s", [None, 0.2])
def test_finish_gives_up_on_the_rows_of_a_hung_tracker_but_still_ends_its_run(timeout_s):
    """The rows still queued after the flush timeout (the sinks' own, or finish's ``timeout_s``, as after a
    second Ctrl-C) are given up with one WARNING; the run is still ended, from the caller (it was left
    RUNNING for ever)."""
    gate = threading.Event()  # never set: the tracker's row delivery hangs
    rec = Recorder(gate=gate)
    warnings: list[str] = []
    sinks = TrackingSinks([rec], warnings.append, flush_timeout_s=0.5)
    sinks.start({})
    sinks.log_metrics("step", 1, {"loss": 1.0})
    assert rec.entered.wait(10)
    sinks.log_metrics("step", 2, {"loss": 0.5})
    sinks.finish("KILLED", timeout_s=timeout_s)
    limit = "0.5" if timeout_s is None else "0.2"
    assert warnings == [
        f"WARNING: tracking: 2 items were not delivered within {limit} s (finish included); metrics.jsonl keeps "
        "every row; ending the tracked runs without them"
    ]
    assert rec.calls[-1] == ("finish", "KILLED") and ("row", "step", 2, {"loss": 0.5}) not in rec.calls
    assert sinks.live == []
    gate.set()


def test_rows_past_max_pending_are_dropped_with_one_warning_and_counted():
    gate = threading.Event()
    rec = Recorder(gate=gate)
    warnings: list[str] = []
    sinks = TrackingSinks([rec], warnings.append, max_pending=3)
    sinks.start({})
    sinks.log_metrics("step", 1, {"loss": 1.0})
    assert rec.entered.wait(10)  # row 1 is out of the queue, inside the blocked tracker
    for step in range(2, 8):  # 3 fit in the queue, 3 are dropped
        sinks.log_metrics("step", step, {"loss": 1.0})
    assert len(warnings) == 1 and "3 items wait for the trackers; new items are dropped" in warnings[0]
    gate.set()
    sinks.finish()
    assert [c[2] for c in rec.calls if c[0] == "row"] == [1, 2, 3, 4]
    assert warnings[-1] == "WARNING: tracking: 3 items were dropped while the trackers lagged behind"


def test_without_background_every_call_runs_in_the_caller():
    rec = Recorder()
    sinks = TrackingSinks([rec], print, background=False)
    sinks.start({})
    sinks.log_metrics("step", 1, {"loss": 1.0})
    assert rec.calls[-1] == ("row", "step", 1, {"loss": 1.0})  # delivered before the call returned
    sinks.log_artifact("x.png")
    assert rec.calls[-1] == ("artifact", "x.png")
    sinks.detach()
    assert rec.calls[-1] == ("finish", "FINISHED") and sinks.live == []


def test_mlflow_logs_a_batch_of_rows_in_log_batch_calls_of_at_most_1000_metrics(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    t = MlflowTracker((tmp_path / "mlruns").as_uri(), "delivery", "batch")
    run_id = t.start(None)
    sizes: list[int] = []
    real = t.client.log_batch

    def counting(run, metrics=(), **kw):
        sizes.append(len(metrics))
        return real(run, metrics=metrics, **kw)

    t.client.log_batch = counting
    rows = [("step", s, {"loss": 1.0 / s, "lr": 0.1, "note": "text"}, 1_700_000_000.0 + s) for s in range(1, 601)]
    t.log_rows(rows)  # 1,200 numeric metrics
    assert sizes == [1000, 200]
    hist = t.client.get_metric_history(run_id, "step/loss")
    assert sorted((m.step, m.value) for m in hist) == [(s, 1.0 / s) for s in range(1, 601)]
    assert {m.timestamp for m in hist if m.step == 7} == {1_700_000_007_000}  # the row's time, not delivery's


def test_a_stop_after_an_epochs_last_step_leaves_that_step_to_the_resumed_run(tmp_path):
    """The row of an epoch's last step reaches the trackers only with the epoch's row. A run stopped
    between that step and the evaluation (KILLED) has not used the step in the trackers; the resumed run, which
    evaluates the epoch, sends the step row (kept in metrics.jsonl) and the validation row at it: no step is used
    by both segments, and each row reaches the trackers once."""
    from trainer.engine.logging import MetricsLogger

    first, second = Recorder("rec"), Recorder("rec")
    log = MetricsLogger(tmp_path, enabled=True)
    log.start_tracking([first], {}, {}, {})
    for step in (1, 2, 3, 4):  # an epoch of 4 steps; the stop comes after step 4, before the evaluation
        log.step(step, {"loss": 1.0 / step}, every=1, last_of_epoch=step == 4)
    log.close(status="KILLED")

    log = MetricsLogger(tmp_path, enabled=True)
    assert log.resume_at(4, evaluated=False) == 0  # the step rows are kept: step 4 was trained
    log.start_tracking([second], {"rec": "run-1"}, {}, {})
    log.epoch(1, 4, {"val_top1": 0.5})
    log.close(status="FINISHED")

    rows = lambda rec: [c[1:3] for c in rec.calls if c[0] == "row"]  # noqa: E731 - (kind, step)
    assert rows(first) == [("step", 1), ("step", 2), ("step", 3)]
    assert rows(second) == [("step", 4), ("epoch", 4)]
    assert first.calls[-1] == ("finish", "KILLED") and second.calls[-1] == ("finish", "FINISHED")


def test_without_a_stop_the_held_row_goes_with_the_epoch_row(tmp_path):
    from trainer.engine.logging import MetricsLogger

    rec = Recorder("rec")
    log = MetricsLogger(tmp_path, enabled=True)
    log.start_tracking([rec], {}, {}, {})
    log.step(1, {"loss": 1.0}, every=1)
    log.step(2, {"loss": 0.5}, every=1, last_of_epoch=True)
    log.epoch(1, 2, {"val_top1": 0.5})
    log.step(3, {"loss": 0.4}, every=1, last_of_epoch=True)  # a last step, then the run ends without its epoch row
    log.close(status="FINISHED")
    assert [c[1:3] for c in rec.calls if c[0] == "row"] == [("step", 1), ("step", 2), ("epoch", 2), ("step", 3)]


@pytest.mark.parametrize(
    ("status", "preempting", "code"), [("KILLED", True, 1), ("FAILED", False, 1), ("FINISHED", False, 0)]
)
def test_a_resumable_wandb_stop_is_marked_preempting_not_failed(tmp_path, status, preempting, code):
    """A run stopped with a checkpoint (KILLED, exit 75 or 130) is ``mark_preempting()``-ed before
    it finishes, so W&B shows it resumable; FAILED and FINISHED are not. (The W&B run is a recording double.)"""
    from trainer.engine.trackers import WandbTracker

    class Run:
        calls: list = []

        def mark_preempting(self):
            self.calls.append("preempting")

        def finish(self, exit_code):
            self.calls.append(("finish", exit_code))

    tracker = WandbTracker("p", None, tmp_path)
    tracker.run = Run()
    tracker.finish(status)
    assert tracker.run.calls == (["preempting"] if preempting else []) + [("finish", code)]
