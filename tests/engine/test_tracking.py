"""Experiment tracking with the real libraries, offline: MLflow's file store under tmp_path, W&B in
offline mode. After a short digits run the tracked metrics equal the JSONL rows (``<kind>/<key>`` at the row's step),
a resumed run appends to the same tracked run (its id lives in the checkpoint), and an unreachable tracker or a
missing package is a warning line, never a lost run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_trainer, tiny_overrides

mlflow = pytest.importorskip("mlflow")


def _flags(overrides: dict) -> list[str]:
    out = []
    for k, v in overrides.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out


def _rows(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _expected(rows: list[dict]) -> dict:
    """``<kind>/<key>`` -> sorted [(step, value)] of the JSONL rows' finite numbers (what a tracker must hold)."""
    out: dict = {}
    for r in rows:
        for k, v in r.items():
            if k in ("kind", "step", "time") or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if math.isfinite(v):
                out.setdefault(f"{r['kind']}/{k}", []).append((r["step"], float(v)))
    return {k: sorted(v) for k, v in out.items()}


def _tracking_ids(ckpt_dir: Path) -> dict:
    latest = (ckpt_dir / "latest").read_text().strip()
    return torch.load(ckpt_dir / latest / "state.pt", map_location="cpu", weights_only=False)["tracking"]


def _mlflow_history(store: str, run_id: str) -> dict:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=store)
    keys = c.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in c.get_metric_history(run_id, k)) for k in keys}


def test_mlflow_metrics_equal_jsonl_and_resume_appends_to_the_same_run(tiny_digits, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = (tmp_path / "mlruns").as_uri()
    o = tiny_overrides(tiny_digits, tmp_path, epochs=1, max_steps_per_epoch=3, log_every_steps=1)
    track = ["--tracking", "mlflow", "--tracking-uri", store, "--tracking-experiment", "digits-test"]
    first = run_trainer([*_flags(o), *track, "--tracking-run-name", "first"], timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "WARNING: tracking" not in first.stdout + first.stderr
    run_id = _tracking_ids(tmp_path / "ckpt")["mlflow"]
    rows = _rows(tmp_path / "logs")
    assert _mlflow_history(store, run_id) == _expected(rows)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(run_id)
    params, tags = run.data.params, run.data.tags
    assert params["model"] == "resnet18" and params["lr"] == "0.0125" and params["tracking"] == '["mlflow"]'
    assert params["data_dir"] == str(tiny_digits) and len(params) >= 100  # the whole flat config
    assert tags["task"] == "classification" and tags["model"] == "resnet18" and tags["device"] == "cpu"
    assert tags["torch"] == torch.__version__ and "checkpoint_final" in tags
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    assert [a.path for a in client.list_artifacts(run_id)] == ["curves.png"]

    # resume with one more epoch (a changed schedule: --force-resume): the same MLflow run grows
    o2 = {**o, "epochs": 2}
    second = run_trainer([*_flags(o2), *track, "--force-resume"], timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert _tracking_ids(tmp_path / "ckpt")["mlflow"] == run_id
    exp = client.get_experiment_by_name("digits-test")
    assert len(client.search_runs([exp.experiment_id])) == 1
    rows2 = _rows(tmp_path / "logs")
    assert len(rows2) > len(rows) and max(r["step"] for r in rows2) > max(r["step"] for r in rows)
    assert _mlflow_history(store, run_id) == _expected(rows2)

    # predict --track: the drawn PNGs and predictions.json join the same run, whose status stays FINISHED
    from trainer.cli import main

    val = sorted((tiny_digits / "val" / "3").glob("*.png"))[:3]
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for f in val:
        (imgs / f.name).write_bytes(f.read_bytes())
    argv = ["predict", "--checkpoint", str(tmp_path / "ckpt"), "--images", str(imgs), "--out", str(tmp_path / "p3")]
    assert main([*argv, "--device", "cpu", "--track"]) == 0
    uploaded = sorted(a.path for a in client.list_artifacts(run_id, "p3"))
    assert uploaded == sorted(["p3/predictions.json", *(f"p3/{f.stem}.png" for f in val)])
    assert client.get_run(run_id).info.status == "FINISHED" and len(client.search_runs([exp.experiment_id])) == 1


def _wandb_records(path: Path) -> list:
    """Records of a W&B ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-log chunks in
    32 KiB blocks (crc32 4 bytes, length 2 bytes little-endian, type 1 full / 2 first / 3 middle / 4 last), each
    record a ``wandb_internal_pb2.Record``. W&B 0.31 ships no reader of its own (``sdk.internal.datastore`` is gone)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def test_wandb_offline_run_holds_the_jsonl_metrics(tiny_digits, tmp_path):
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb-home")}
    env["WANDB_CONFIG_DIR"] = env["WANDB_CACHE_DIR"] = str(tmp_path / "wandb-home")
    o = tiny_overrides(tiny_digits, tmp_path, epochs=1, max_steps_per_epoch=3, log_every_steps=1)
    proc = run_trainer(
        [*_flags(o), "--tracking", "wandb", "--tracking-experiment", "digits-test"], env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNING: tracking" not in proc.stdout + proc.stderr
    run_id = _tracking_ids(tmp_path / "ckpt")["wandb"]
    (run_dir,) = (tmp_path / "logs" / "wandb").glob(f"offline-run-*-{run_id}")
    assert (run_dir / "files" / "curves.png").is_file()
    got: dict = {}
    config = {}
    for rec in _wandb_records(run_dir / f"run-{run_id}.wandb"):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            for k, v in items.items():
                if k.startswith(("step/", "epoch/")):
                    got.setdefault(k, []).append((items["global_step"], float(v)))
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    assert {k: sorted(v) for k, v in got.items()} == _expected(_rows(tmp_path / "logs"))
    assert config["model"] == "resnet18" and config["tag/task"] == "classification"

    # resumed (one more epoch): a second offline-run folder of the same id whose W&B steps continue from the
    # checkpoint's step (they restarted at 0, so `wandb sync .../offline-run-*` replaced the first folder's history)
    o2 = {**o, "epochs": 2}
    proc = run_trainer(
        [*_flags(o2), "--tracking", "wandb", "--tracking-experiment", "digits-test", "--force-resume"],
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _tracking_ids(tmp_path / "ckpt")["wandb"] == run_id
    folders = sorted((tmp_path / "logs" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(folders) == 2
    synced: dict = {}  # what syncing the folders in the documented (glob) order keeps: later rows win per step
    spans = []
    for folder in folders:
        steps = []
        for rec in _wandb_records(folder / f"run-{run_id}.wandb"):
            if rec.WhichOneof("record_type") != "history":
                continue
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            assert items["_step"] == items["global_step"], items  # W&B's step is the optimizer step
            steps.append(items["_step"])
            for k, v in items.items():
                if k.startswith(("step/", "epoch/")):
                    synced.setdefault(k, {})[items["global_step"]] = float(v)
        spans.append((min(steps), max(steps)))
    assert spans[1][0] > spans[0][0] and spans[1][1] > spans[0][1]
    expected = _expected(_rows(tmp_path / "logs"))
    assert {k: sorted(v.items()) for k, v in synced.items()} == expected


def test_unreachable_mlflow_and_missing_wandb_are_warnings(tiny_digits, tmp_path, monkeypatch, capsys):
    import sys

    from trainer.config import load_config
    from trainer.engine import run as train

    monkeypatch.setitem(sys.modules, "wandb", None)  # "import wandb" raises ImportError: the package is missing
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    o = tiny_overrides(tiny_digits, tmp_path, epochs=1, max_steps_per_epoch=2)
    cfg = load_config(None, {**o, "tracking": ["mlflow", "wandb"], "tracking_uri": "http://127.0.0.1:9"})
    assert train.run(cfg) == 0
    out = capsys.readouterr()
    lines = [x for x in (out.out + out.err).splitlines() if x.startswith("WARNING: tracking")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("WARNING: tracking mlflow: start failed (ConnectionRefusedError")
    assert lines[1].startswith("WARNING: tracking wandb: start failed (ModuleNotFoundError")
    assert all(x.endswith("training continues without it") for x in lines)
    assert (tmp_path / "logs" / "metrics.jsonl").stat().st_size > 0 and (tmp_path / "ckpt" / "latest").is_file()

    # predict --track on that checkpoint: refused, naming the trackers the training asked for (not "without")
    from trainer.cli import main

    val = tiny_digits / "val" / "3"
    argv = ["predict", "--checkpoint", str(tmp_path / "ckpt"), "--images", str(val), "--out", str(tmp_path / "p")]
    assert main([*argv, "--device", "cpu", "--track"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("error: --track: ") and "its training asked for --tracking mlflow,wandb but no tracker" in err
    assert not any((tmp_path / "p").iterdir())  # nothing predicted


def test_a_sagemaker_tracking_server_arn_resolves_to_the_plugin_store():
    """The pinned sagemaker-mlflow plugin is installed and takes ``arn:aws:sagemaker:...`` tracking URIs (what
    ``infra`` grants the training roles ``sagemaker-mlflow:*`` for); building the store sends nothing."""
    from mlflow.tracking._tracking_service.utils import _get_store

    store = _get_store("arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/team")
    assert type(store).__module__.startswith("sagemaker_mlflow")


def test_mlflow_without_a_uri_logs_to_a_file_store_in_the_log_dir(tiny_digits, tmp_path, monkeypatch, capsys):
    """No ``--tracking-uri`` and no ``MLFLOW_TRACKING_URI``: MLflow 3.x's own default (``sqlite:///mlflow.db``) needs
    SQLAlchemy, which mlflow-skinny lacks; the run logs to ``<log_dir>/mlruns`` instead, the checkpoint records that
    URI, and ``predict --track`` from another folder (no variable set) finds the run there."""
    from mlflow.tracking import MlflowClient

    from trainer.cli import main
    from trainer.config import load_config
    from trainer.engine import run as train

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    o = tiny_overrides(tiny_digits, tmp_path, epochs=1, max_steps_per_epoch=2, log_dir="logs")
    assert train.run(load_config(None, {**o, "tracking": ["mlflow"]})) == 0
    out = capsys.readouterr()
    assert "WARNING: tracking" not in out.out + out.err
    store = (tmp_path / "logs" / "mlruns").as_uri()
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    state = torch.load(tmp_path / "ckpt" / latest / "state.pt", map_location="cpu", weights_only=False)
    assert state["tracking_uri"] == store and state["config"]["tracking_uri"] is None
    run = MlflowClient(tracking_uri=store).get_run(state["tracking"]["mlflow"])
    assert run.info.status == "FINISHED" and "epoch/val_top1" in run.data.metrics

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    argv = ["predict", "--checkpoint", str(tmp_path / "ckpt"), "--images", str(tiny_digits / "val" / "3")]
    assert main([*argv, "--out", str(tmp_path / "p"), "--device", "cpu", "--limit", "2", "--track"]) == 0
    assert "track: 3 files under p/ -> mlflow run" in capsys.readouterr().out
    uploaded = MlflowClient(tracking_uri=store).list_artifacts(run.info.run_id, "p")
    assert len(uploaded) == 3 and not (elsewhere / "mlruns").exists() and not (elsewhere / "mlflow.db").exists()

    # MLFLOW_TRACKING_URI (relative) is what a run resolves, made absolute, before the log_dir default
    from trainer.engine.trackers import resolve_mlflow_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:./there")
    assert resolve_mlflow_uri(None, tmp_path / "logs") == (elsewhere / "there").as_uri()
    assert resolve_mlflow_uri("http://host:5000", tmp_path / "logs") == "http://host:5000"


def _mlflow_status(store: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking_uri=store)
    return [r.info.status for r in c.search_runs([c.get_experiment_by_name("trainstack").experiment_id])]


def test_failed_runs_are_marked_failed_in_mlflow_and_wandb(tiny_digits, tmp_path, monkeypatch, capsys):
    """A non-finite loss (exit 3): MLflow FAILED, W&B's offline run exits 1; a data error found in the evaluation
    (exit 2) and a crash (an exception that is a bug, re-raised) end their MLflow runs FAILED too."""
    import shutil

    from trainer.config import load_config
    from trainer.engine import run as train
    from trainer.engine.trainer import Trainer

    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb-home")}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-home"))
    nan = tmp_path / "nan"
    o = tiny_overrides(tiny_digits, nan, epochs=1, lr=1e30, gradient_clip=0.0, log_every_steps=1)
    cfg = load_config(None, {**o, "tracking": ["mlflow", "wandb"], "tracking_uri": str(nan / "mlruns")})
    assert train.run(cfg) == 3
    assert "loss became NaN/inf" in capsys.readouterr().err
    assert _mlflow_status(str(nan / "mlruns")) == ["FAILED"]
    (wandb_file,) = (nan / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    exits = [r.exit.exit_code for r in _wandb_records(wandb_file) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]

    # exit 2 in the evaluation: every val scan of digit 0 is cut after its PNG header (10 % > max_bad_fraction 1 %);
    # the start-up check reads headers only, as for a split of more than FULL_CHECK_MAX_FILES files
    from trainer.data.formats import imagefolder

    monkeypatch.setattr(imagefolder, "FULL_CHECK_MAX_FILES", 0)
    data = tmp_path / "digits"
    shutil.copytree(tiny_digits, data)
    for f in (data / "val" / "0").iterdir():
        f.write_bytes(f.read_bytes()[:60])
    bad = tmp_path / "bad"
    o = tiny_overrides(data, bad, epochs=1, max_steps_per_epoch=1)
    assert train.run(load_config(None, {**o, "tracking": ["mlflow"], "tracking_uri": str(bad / "mlruns")})) == 2
    assert "val: 8 of 80 files could not be decoded, more than max_bad_fraction" in capsys.readouterr().err
    assert _mlflow_status(str(bad / "mlruns")) == ["FAILED"]

    def crash(self, model):
        raise ZeroDivisionError("a bug in the evaluation")

    monkeypatch.setattr(Trainer, "evaluate", crash)
    bug = tmp_path / "bug"
    o = tiny_overrides(tiny_digits, bug, epochs=1, max_steps_per_epoch=1)
    with pytest.raises(ZeroDivisionError):
        train.run(load_config(None, {**o, "tracking": ["mlflow"], "tracking_uri": str(bug / "mlruns")}))
    assert _mlflow_status(str(bug / "mlruns")) == ["FAILED"]


def test_a_server_that_never_answers_costs_seconds_and_the_warning_keeps_the_cause(monkeypatch, tmp_path):
    """An MLflow or W&B server that accepts the connection and never answers fails the start
    after CONNECT_TIMEOUT_S (here 0.5 s), not after the library's own retries (~70 s, ~90 s); the WARNING line keeps
    the innermost cause of a long wrapped error (it was cut before it)."""
    import socket

    from trainer.engine import trackers
    from trainer.engine.trackers import MlflowTracker, WandbTracker
    from trainer.engine.tracking import TrackingSinks

    pytest.importorskip("wandb")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (the kernel completes the handshake) and never answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    monkeypatch.setattr(trackers, "CONNECT_TIMEOUT_S", 0.5)
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    warnings: list[str] = []
    try:
        sinks = TrackingSinks([MlflowTracker(url, "e", None), WandbTracker("e", None, tmp_path)], warnings.append)
        sinks.start({})
    finally:
        silent.close()
    assert sinks.live == [] and len(warnings) == 2, warnings
    for name, line in zip(("mlflow", "wandb"), warnings):
        assert line.startswith(
            f"WARNING: tracking {name}: start failed (TimeoutError: {url} did not answer within 0.5 s"
        )

    class Wrapped(Exception):
        pass

    class Failing(trackers.Tracker):
        name = "mlflow"

        def start(self, run_id):
            try:
                raise ConnectionRefusedError(111, "Connection refused")
            except ConnectionRefusedError as e:
                raise Wrapped("API request to endpoint /api/2.0/mlflow/runs/create failed " + "x" * 600) from e

    warnings.clear()
    TrackingSinks([Failing()], warnings.append).start({})
    assert warnings[0].startswith("WARNING: tracking mlflow: start failed (Wrapped: API request to endpoint")
    assert "...; cause: ConnectionRefusedError: [Errno 111] Connection refused); training continues" in warnings[0]
