"""``python -m trainer export`` on real tiny checkpoints: a 1-epoch digits classifier, a 1-step
RID U-Net, a 1-epoch video frame transformer on the shared clips, a 1-step DINO. ONNX (ONNX Runtime vs PyTorch:
max |diff| < 1e-3, top-1 / mask / detection agreement 100 %, batch 1 and 3), TorchScript and safetensors; the
metadata, the model card; the bad-input rows (exit 2, one line)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from bad_input_table import Case, run_case, trainer_cmd
from test_detection import _cfg as detection_cfg
from test_predict import _facemask_subset, _fit, digits_run  # noqa: F401 - digits_run is a fixture

from trainer.cli import main
from trainer.data.transforms import IMAGENET_MEAN, IMAGENET_STD

pytestmark = pytest.mark.slow


def _export(ckpt: Path, fmt: str, out: Path, capsys, *extra: str) -> list[str]:
    assert main(["export", "--checkpoint", str(ckpt), "--format", fmt, "--out", str(out), *extra]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    with capsys.disabled():  # shown with -s: the figures of docs/benchmarks.md ("Export")
        print("\n" + "\n".join(lines))
    return lines


def _check_verify_lines(lines: list[str], agreement: str) -> None:
    diffs = [
        float(m.group(1)) for line in lines if (m := re.search(r"max \|diff\| \w+(?: vs PyTorch)?: ?([\d.e+-]+)", line))
    ]
    assert diffs and max(diffs) < 1e-3, lines
    assert any(agreement in line and "100." in line for line in lines), lines


def _ort(path: Path, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})


def _check_onnx(path: Path, example: np.ndarray, agreement_key: int) -> dict:
    """Metadata of ``path``; ORT at batch 1 and 3 gives the same rows (dynamic batch), opset >= 17."""
    model = onnx.load(str(path))
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}  # standard ops only
    meta = {p.key: p.value for p in model.metadata_props}
    three = _ort(path, example[:3])
    one = _ort(path, example[:1])
    assert three[0].shape[0] == 3 and one[0].shape[0] == 1
    assert np.abs(three[0][:1] - one[0]).max() < 1e-4
    assert (three[agreement_key][:1] == one[agreement_key]).all()
    return meta


def test_classification_exports_onnx_torchscript_safetensors(digits_run, tmp_path, capsys):  # noqa: F811 - the fixture
    ckpt, _ = digits_run
    lines = _export(ckpt, "onnx", tmp_path / "onnx", capsys)
    _check_verify_lines(lines, "top-1 agreement")
    assert "verify: on 4 files of" in "\n".join(lines)
    assert lines[-1].startswith("export: classification resnet18 -> ") and "ema weights" in lines[-1]
    meta = _check_onnx(tmp_path / "onnx" / "model.onnx", np.random.rand(3, 3, 32, 32).astype(np.float32) * 255, 1)
    assert json.loads(meta["classes"]) == [str(i) for i in range(10)]
    assert json.loads(meta["class_ids"]) == list(range(10))
    assert json.loads(meta["input_size"]) == [32, 32] and json.loads(meta["top_k"]) == 5
    assert json.loads(meta["mean"]) == list(IMAGENET_MEAN) and json.loads(meta["std"]) == list(IMAGENET_STD)
    assert re.fullmatch(r"[0-9a-f]{16}", meta["config_fingerprint"])
    card = (tmp_path / "onnx" / "model_card.md").read_text()
    for fragment in (
        "classification model `resnet18`",
        "0: 0, 1: 1",
        "val_top1",
        meta["config_fingerprint"],
        "top-1 agreement 100.0 %",
        "BSD-3-Clause",
        "python -m trainer train --config",
        "opset 18",
    ):
        assert fragment in card, fragment

    lines = _export(ckpt, "torchscript", tmp_path / "ts", capsys, "--weights", "raw")
    _check_verify_lines(lines, "top-1 agreement")
    assert "model weights" in lines[-1]
    extra = {"metadata.json": ""}
    ts = torch.jit.load(str(tmp_path / "ts" / "model.pt"), _extra_files=extra)
    assert json.loads(extra["metadata.json"])["weights"] == "model"
    assert ts(torch.rand(2, 3, 32, 32) * 255)[1].shape == (2, 10)

    from safetensors import safe_open

    _export(ckpt, "safetensors", tmp_path / "st", capsys)
    with safe_open(str(tmp_path / "st" / "model.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["classes"])[:2] == ["0", "1"] and "fc.weight" in f.keys()
    assert (tmp_path / "st" / "model_card.md").exists()


def test_segmentation_exports_onnx_with_mask_agreement(shared_data, tmp_path, capsys):
    from test_segmentation import rid_cfg

    cfg = rid_cfg(shared_data, tmp_path, max_steps_per_epoch=1)
    _fit(cfg)
    lines = _export(tmp_path / "ck", "onnx", tmp_path / "onnx", capsys)
    _check_verify_lines(lines, "mask pixel agreement")
    meta = _check_onnx(tmp_path / "onnx" / "model.onnx", np.random.rand(3, 3, 64, 64).astype(np.float32) * 255, 1)
    assert json.loads(meta["classes"]) == list(cfg.classes) and json.loads(meta["size_divisor"]) == 32
    assert "palette" in meta and json.loads(meta["outputs"]) == ["logits", "mask"]
    card = (tmp_path / "onnx" / "model_card.md").read_text()
    assert "mask pixel agreement 100.000 %" in card and "segmentation_models_pytorch" in card
    # the card's size rule: a 500x375 photo, shorter side resized to 64 (85x64), padded to multiples of 32: 96x64
    assert json.loads(meta["dynamic_axes"]) == ["batch", "height", "width"] and "multiples of 32" in card
    assert "(batch, height, width dynamic)" in card
    from trainer.trained import load_model, resolve_checkpoint

    task, model, _, _ = load_model(resolve_checkpoint(tmp_path / "ck"), torch.device("cpu"), True)
    photo = torch.zeros(2, 3, 64, 96)
    photo[:, :, :, :85] = torch.rand(2, 3, 64, 85, generator=torch.Generator().manual_seed(0)) * 255
    with torch.no_grad():
        ref = [o.numpy() for o in task.export_module(model.float().eval())(photo)]
    got = _ort(tmp_path / "onnx" / "model.onnx", photo.numpy())
    assert got[0].shape == (2, len(cfg.classes), 64, 96) and np.abs(got[0] - ref[0]).max() < 1e-3
    assert (got[1] == ref[1]).mean() > 0.999
    lines = _export(tmp_path / "ck", "torchscript", tmp_path / "ts", capsys)
    _check_verify_lines(lines, "mask pixel agreement")


def test_video_exports_onnx_with_top1_agreement(shared_data, tmp_path, capsys):
    from test_video import video_cfg

    root = tmp_path / "videos"
    for split in ("train", "val"):
        for f in sorted((shared_data / "video-clips").iterdir()):
            (root / split / f.stem).mkdir(parents=True)
            (root / split / f.stem / f.name).symlink_to(f)
    cfg = video_cfg(root, tmp_path, video_format="folders", num_frames=4, frame_stride=4, batch_size=7)
    _fit(cfg)
    lines = _export(tmp_path / "ck", "onnx", tmp_path / "onnx", capsys)
    _check_verify_lines(lines, "top-1 agreement")
    assert "4 files of" in "\n".join(lines)
    clips = np.random.rand(3, 4, 3, 32, 32).astype(np.float32) * 255
    meta = _check_onnx(tmp_path / "onnx" / "model.onnx", clips, 1)
    assert json.loads(meta["num_frames"]) == 4 and json.loads(meta["inputs"]) == ["clip"]
    assert len(json.loads(meta["classes"])) == 7
    # the card says what predict does to each frame: resize the shorter side, then the centre crop
    card = (tmp_path / "onnx" / "model_card.md").read_text()
    assert "each resized (shorter side to 32 px, antialiased) and centre-cropped to 32x32" in card


def test_detection_exports_onnx_torchscript_safetensors(shared_data, tmp_path, capsys):
    """DINO through the reference attention: standard ONNX ops, a dynamic height and width, so each image alone
    at its own size gives ``predict``'s detections (files of three sizes, portrait and landscape) and a padded
    batch gives evaluation's padded path; TorchScript on its fixed canvas, reported against predict;
    safetensors."""
    from trainer.tasks.base import denormalize
    from trainer.tasks.detection.export import match_detections
    from trainer.trained import load_model, resolve_checkpoint

    data, images = _facemask_subset(shared_data, tmp_path, 2)
    t = _fit(detection_cfg(data, tmp_path, max_steps_per_epoch=1))  # eval_size 64, max_size 96: sides below 65
    lines = _export(tmp_path / "ck", "onnx", tmp_path / "onnx", capsys)
    _check_verify_lines(lines, "detection agreement")
    text = "\n".join(lines)
    assert "verify: on 4 files of" in text and "maksssksksss0_png" in text and "at its own size, vs predict" in text
    path = tmp_path / "onnx" / "model.onnx"
    model = onnx.load(str(path))
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"} and "GridSample" in {
        n.op_type for n in model.graph.node
    }
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3, "height", "width"], dims
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["input_size"] == "any H and W up to 128 px"  # max_size 96 rounded up to 64
    assert json.loads(meta["dynamic_axes"]) == ["batch", "height", "width"]
    assert json.loads(meta["num_select"]) == 30 and json.loads(meta["classes"]) == t.label_space["categories"]
    assert json.loads(meta["class_ids"]) == t.label_space["category_ids"]

    # each file alone at its own size through ONNX Runtime = predict (boxes x original size)
    task, torch_model, _, _ = load_model(resolve_checkpoint(tmp_path / "ck"), torch.device("cpu"), True)
    torch_model.float().eval()
    src = shared_data / "facemask-coco"
    listed = json.loads((src / "annotations" / "custom_train.json").read_text())["images"]
    portrait = next(i for i in listed if i["height"] > i["width"])
    squarish = next(i for i in listed if abs(i["height"] - i["width"]) < 0.1 * i["width"])
    files = [str(src / "train2017" / i["file_name"]) for i in (images[0], portrait, squarish)]
    batch = task.predict_inputs(files)
    assert len(set(batch["sizes"])) == 3 and any(h > w for h, w in batch["sizes"]), batch["sizes"]
    assert min(min(hw) for hw in batch["sizes"]) < 65  # below the traced range's start: ONNX Runtime runs it too
    with torch.no_grad():
        predicted = task.predict(torch_model, batch)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    pixels = denormalize(batch["image"])
    for i, (h, w) in enumerate(batch["sizes"]):
        one = {"image": pixels[i : i + 1, :, :h, :w].numpy(), "image_size": np.array([[h, w]], dtype=np.int64)}
        scores, labels, boxes = sess.run(None, one)
        ref = predicted[i]
        wh = batch["orig_size"][i].flip(0).repeat(2).numpy()  # W, H, W, H
        assert np.abs(scores[0] - ref["scores"].numpy()).max() < 1e-4
        assert np.abs(boxes[0] * wh - ref["boxes"].numpy()).max() < 0.05  # pixels
        matched, total = match_detections(
            [ref["scores"][None].numpy(), ref["labels"][None].numpy(), ref["boxes"][None].numpy()],
            [scores, labels, boxes * wh],
        )
        assert matched == total == 30

    # the padded batch (dynamic batch and size) = predict's path on the same padding (evaluation's)
    sizes = torch.tensor(batch["sizes"], dtype=torch.int64)
    scores, labels, boxes = sess.run(None, {"image": pixels.numpy(), "image_size": sizes.numpy()})
    with torch.no_grad():
        padded = task.predict(torch_model, dict(batch, own_size=False))
    assert np.abs(scores - np.stack([p["scores"].numpy() for p in padded])).max() < 1e-4

    lines = _export(tmp_path / "ck", "torchscript", tmp_path / "ts", capsys)  # traced at the fixed canvas
    assert any("128x128 canvas vs predict" in line for line in lines), lines
    assert any("detection agreement" in line for line in lines), lines
    _export(tmp_path / "ck", "safetensors", tmp_path / "st", capsys)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "st" / "model.safetensors"), "pt") as f:
        st_meta = f.metadata()
    assert json.loads(st_meta["num_select"]) == 30 and json.loads(st_meta["score_threshold"]) == 0.3
    card = (tmp_path / "onnx" / "model_card.md").read_text()
    assert '"num_select": 30' in card and "detection agreement 100.0 %" in card
    assert "128x128 canvas" in (tmp_path / "ts" / "model_card.md").read_text()


# --- bad inputs ---------------------------------------------------------------------------------------------
def _missing(tmp: Path, ckpt: Path) -> list[str]:
    return trainer_cmd("export", "--checkpoint", "nope", "--format", "onnx", "--out", "out")


def _other_task(tmp: Path, ckpt: Path) -> list[str]:
    return trainer_cmd("export", "--checkpoint", str(ckpt), "--format", "onnx", "--out", "out", "--task", "video")


def _corrupt(tmp: Path, ckpt: Path) -> list[str]:
    latest = ckpt / (ckpt / "latest").read_text().strip()
    shutil.copytree(latest, tmp / "ckpt-x")
    with open(tmp / "ckpt-x" / "state.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 16)
    return trainer_cmd("export", "--checkpoint", "ckpt-x", "--format", "onnx", "--out", "out")


def _out_under_file(tmp: Path, ckpt: Path) -> list[str]:
    (tmp / "afile").write_text("a file")
    return trainer_cmd("export", "--checkpoint", str(ckpt), "--format", "onnx", "--out", "afile/out")


def _bad_format(tmp: Path, ckpt: Path) -> list[str]:
    return trainer_cmd("export", "--checkpoint", str(ckpt), "--format", "tflite", "--out", "out")


def _low_opset(tmp: Path, ckpt: Path) -> list[str]:
    return trainer_cmd("export", "--checkpoint", str(ckpt), "--format", "onnx", "--out", "out", "--opset", "13")


def _high_opset(tmp: Path, ckpt: Path) -> list[str]:
    return trainer_cmd("export", "--checkpoint", str(ckpt), "--format", "onnx", "--out", "out", "--opset", "99")


def _opset_17(tmp: Path, ckpt: Path) -> list[str]:
    return trainer_cmd("export", "--checkpoint", str(ckpt), "--format", "onnx", "--out", "out", "--opset", "17")


def _opset_17_torchscript(tmp: Path, ckpt: Path) -> list[str]:
    return trainer_cmd("export", "--checkpoint", str(ckpt), "--format", "torchscript", "--out", "out", "--opset", "17")


def _opset_safetensors(tmp: Path, ckpt: Path) -> list[str]:
    return trainer_cmd("export", "--checkpoint", str(ckpt), "--format", "safetensors", "--out", "out", "--opset", "18")


def _out_holds_another_format(tmp: Path, ckpt: Path) -> list[str]:
    (tmp / "other").mkdir()
    (tmp / "other" / "model.pt").write_bytes(b"an earlier torchscript export")
    return trainer_cmd("export", "--checkpoint", str(ckpt), "--format", "onnx", "--out", "other")


def _out_holds_another_checkpoint(tmp: Path, ckpt: Path) -> list[str]:
    (tmp / "other").mkdir()
    (tmp / "other" / "model_card.md").write_text("Exported 2026-11-01 by `x` from checkpoint `/runs/b/ckpt-000000004`")
    (tmp / "other" / "model.onnx").write_bytes(b"the export of run b")
    return trainer_cmd("export", "--checkpoint", str(ckpt), "--format", "onnx", "--out", "other")


def _no_output(tmp: Path) -> None:
    assert not (tmp / "out").exists() or not any((tmp / "out").iterdir())
    if (tmp / "other").exists():  # the export already there is left as it was
        assert {p.name for p in (tmp / "other").iterdir()} <= {"model.pt", "model.onnx", "model_card.md"}
        assert b"export" in b"".join(p.read_bytes() for p in (tmp / "other").iterdir())


#: (id, setup(tmp, checkpoint_dir) -> argv, fragment of the last stderr line)
ROWS = [
    ("missing-checkpoint", _missing, "error: --checkpoint: nope does not exist"),
    ("checkpoint-of-another-task", _other_task, "is a classification checkpoint, not video"),
    ("corrupt-checkpoint", _corrupt, "SHA-256 differs from the manifest (corrupt)"),
    ("out-cannot-be-created", _out_under_file, "error: --out: cannot create afile/out"),
    ("unsupported-format", _bad_format, "error: export: --format: invalid choice: 'tflite'"),
    ("opset-below-lowest", _low_opset, "error: --opset: got 13; this exporter writes opsets 18 to 25"),
    ("opset-17", _opset_17, "error: --opset: got 17; this exporter writes opsets 18 to 25"),
    ("opset-17-torchscript", _opset_17_torchscript, "error: --opset: got 17; this exporter writes opsets 18 to 25"),
    ("opset-without-onnx", _opset_safetensors, "error: --opset: --format safetensors writes no ONNX opset"),
    ("opset-above-highest", _high_opset, "error: --opset: got 99; this exporter writes opsets 18 to 25"),
    ("out-holds-another-format", _out_holds_another_format, "error: --out: other holds another export (model.pt)"),
    ("out-holds-another-checkpoint", _out_holds_another_checkpoint, "holds the export of another checkpoint"),
]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_export_bad_inputs(row, digits_run, tmp_path):  # noqa: F811 - the fixture
    name, setup, message = row
    ckpt, _ = digits_run
    run_case(Case(name, lambda t: setup(t, ckpt), 2, message, _no_output, env={"OMP_NUM_THREADS": "1"}), tmp_path)


def test_model_card_reproduce_command_retrains_and_says_when_nothing_was_evaluated(digits_run, tmp_path, capsys):  # noqa: F811 - the fixture
    """The card's reproduce command, run as written, trains from scratch into fresh folders (not "nothing left to
    train" from the finished checkpoint folder); a checkpoint without an evaluation says so on its card."""
    import shlex

    from trainer.model_card import metrics_lines as _metrics
    from trainer.model_card import model_card

    ckpt, _ = digits_run
    before = sorted(p.name for p in ckpt.iterdir())
    _export(ckpt, "safetensors", tmp_path / "st", capsys)
    card = (tmp_path / "st" / "model_card.md").read_text()
    assert "these are the validation metrics the training run computed" in card
    (command,) = re.findall(r"- reproduce: `([^`]+)`", card)
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "trainer", "train"]
    assert main(argv[3:]) == 0
    out = capsys.readouterr().out
    assert "nothing left to train" not in out and "done: best top1=" in out
    retrained = sorted((tmp_path / "st" / "retrain" / "checkpoints").glob("ckpt-*"))
    assert retrained and (tmp_path / "st" / "retrain" / "logs" / "metrics.jsonl").stat().st_size > 0
    assert sorted(p.name for p in ckpt.iterdir()) == before

    meta = {"task": "classification", "model": "resnet18", "inputs": ["image"], "outputs": ["logits"]}
    meta.update(input_layout="B,3,H,W", input_size=[32, 32], mean=[0.5], std=[0.5], normalization="in the graph")
    meta.update(dynamic_axes=["batch"])
    meta.update(class_ids=[0], classes=["a"])
    facts = dict.fromkeys(("format", "date", "command", "checkpoint", "weights", "data_dir", "fingerprint"), "x")
    facts.update(how="x", verified_on="", reproduce="python -m trainer train ...", evaluated=False)
    manifest = {"progress": {"epoch": 0, "step_in_epoch": 9, "global_step": 9}}
    text = model_card(meta, facts, _metrics({"history": []}, manifest, "top1"), [], "x")
    assert "no evaluation was recorded in this checkpoint" in text and "validation metrics the training" not in text


def test_export_replaces_its_own_files_atomically_and_falls_back_with_a_warning(
    digits_run,  # noqa: F811 - the fixture
    tmp_path,
    capsys,
    monkeypatch,
):
    """An export into a folder that holds the same checkpoint's export replaces its files, and one
    that fails mid-write (a full disk) leaves the earlier model file whole and no temporary file; a
    dangling ``latest`` and a truncated state.pt whose manifest was rewritten to match both fall back to the older
    checkpoint with the same ``warning: --checkpoint: skipped`` line."""
    import errno
    import hashlib
    import shutil

    import torch.jit

    ckpt, _ = digits_run
    run = tmp_path / "run"
    shutil.copytree(ckpt, run)
    newest = (run / "latest").read_text().strip()
    older = "ckpt-000000001"
    shutil.copytree(run / newest, run / older)  # an older complete checkpoint to fall back to

    def export(fmt: str, out: str) -> tuple[int, str]:
        rc = main(["export", "--checkpoint", str(run), "--format", fmt, "--out", str(tmp_path / out), "--no-verify"])
        return rc, capsys.readouterr().err

    rc, err = export("torchscript", "ts")
    assert rc == 0 and err.startswith("note: --format torchscript: torch ") and "FutureWarning" not in err, err
    assert export("torchscript", "ts")[0] == 0  # the same export again: its files replaced
    before = (tmp_path / "ts" / "model.pt").read_bytes()
    from trainer.engine.durable import WriterLock

    lock = WriterLock(run)  # a training run writing the folder: the reader is not blocked, and says so
    assert lock.acquire() is None
    try:
        rc, err = export("safetensors", "st0")
    finally:
        lock.release()
    assert rc == 0 and f"is being written by a training run (pid {os.getpid()} on host " in err, err

    def full_disk(obj, f, _extra_files=None):
        Path(f).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    with monkeypatch.context() as m:
        m.setattr(torch.jit, "save", full_disk)
        rc, err = export("torchscript", "ts")
    assert rc == 2 and "error: --out: cannot write in" in err and "No space left on device (ENOSPC)" in err
    assert (tmp_path / "ts" / "model.pt").read_bytes() == before  # the earlier export whole, no temporary file
    assert sorted(p.name for p in (tmp_path / "ts").iterdir()) == ["model.pt", "model_card.md", "train_config.yaml"]

    # N13: latest names a checkpoint that is gone
    shutil.move(run / newest, tmp_path / "moved")
    rc, err = export("safetensors", "st1")
    assert (
        rc == 0
        and (
            f"warning: --checkpoint: skipped {newest} (the 'latest' pointer names it, but it does not exist); "
            f"using the older {older}"
        )
        in err
    ), err
    shutil.move(tmp_path / "moved", run / newest)
    # N14: state.pt cut short and its manifest rewritten to match
    state = run / newest / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    manifest = json.loads((run / newest / "manifest.json").read_text())
    digest = hashlib.sha256(state.read_bytes()).hexdigest()
    manifest["files"]["state.pt"] = {"bytes": state.stat().st_size, "sha256": digest}
    (run / newest / "manifest.json").write_text(json.dumps(manifest))
    rc, err = export("safetensors", "st2")
    assert rc == 0 and f"warning: --checkpoint: skipped {newest} (" in err, err
    assert "not a complete torch archive" in err and f"using the older {older}" in err and "Errno 22" not in err
