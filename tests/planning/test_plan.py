"""plan: ranking, time and cost from the catalog, flags (seed 000's 2 processes on a 1-GPU type, indivisible
batch, fits nowhere), probe-report scaling, and the one-line exit-2 errors."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_overrides

import catalog
from trainer.cli import main
from trainer.config import load_config
from trainer.planning.host_ram import GIB
from trainer.planning.memory import MemoryPrediction
from trainer.planning.options import PlanError, PlanOptions
from trainer.planning.plan import gpu_model_of, make_plan, render_plan, verdict

TYPES = ("g5.2xlarge", "g5.12xlarge", "p4d.24xlarge", "ml.g5.2xlarge")


@pytest.fixture()
def cfg(tiny_digits, tmp_path):
    return load_config(None, tiny_overrides(tiny_digits, tmp_path, batch_size=64, epochs=10))


def _rows(plan):
    return {r["instance"]: r for r in plan["rows"]}


def test_time_and_cost_come_from_throughput_and_catalog_prices(cfg):
    plan = make_plan(
        cfg,
        PlanOptions(
            instances=TYPES,
            model_memory_gib=8.0,
            images_per_second=100.0,
            throughput_gpu="A10G",
            dataset_size=100_000,
            scaling_efficiency=0.9,
        ),
    )
    rows = _rows(plan)
    a10g, a100 = catalog.GPU_MODELS["A10G"], catalog.GPU_MODELS["A100"]
    for name in TYPES:
        it, r = catalog.get(name), rows[name]
        per_gpu = 100.0 * it.gpu.relative_throughput / a10g.relative_throughput
        host = per_gpu * it.gpus * (0.9 if it.gpus > 1 else 1.0)
        hours = 10 * 100_000 / host / 3600
        assert r["processes_per_host"] == it.gpus and r["fits"]
        assert r["images_per_s"] == pytest.approx(host, rel=1e-9)
        assert r["run_hours"] == pytest.approx(hours, rel=1e-9)
        assert r["run_usd_on_demand"] == pytest.approx(hours * it.on_demand.usd_per_hour, rel=1e-9)
        assert r["run_usd_spot"] == pytest.approx(hours * it.spot.usd_per_hour, rel=1e-9)
    assert rows["p4d.24xlarge"]["images_per_s"] > rows["g5.12xlarge"]["images_per_s"] * a100.relative_throughput
    costs = [r["run_usd_on_demand"] for r in plan["rows"]]
    assert costs == sorted(costs) and [r["rank"] for r in plan["rows"]] == [1, 2, 3, 4]
    md = render_plan(plan)
    assert md.count("\n| ") == 6 and "| 1 | " in md  # header, separator, 4 ranked rows


def test_flags_two_processes_on_one_gpu_indivisible_batch_and_fits_nowhere(cfg):
    plan = make_plan(
        cfg,
        PlanOptions(
            instances=("ml.g5.2xlarge", "g5.12xlarge"), nproc_per_node=2, model_memory_gib=8.0, dataset_size=1000
        ),
    )
    rows = _rows(plan)
    bad = rows["ml.g5.2xlarge"]  # memory fits; the process count is the mistake: no "fits", ranked last
    assert bad["memory_fits"] and not bad["fits"] and verdict(bad) == "ERROR"
    assert plan["rows"][-1]["instance"] == "ml.g5.2xlarge"
    assert "--nproc-per-node 2 on ml.g5.2xlarge, which has 1 GPU(s)" in bad["errors"][0]
    assert "2 GPU(s) of g5.12xlarge idle" in rows["g5.12xlarge"]["warnings"][0] and rows["g5.12xlarge"]["fits"]
    assert verdict(rows["g5.12xlarge"]) == "yes"  # a warning is not an error
    md_rows = [line for line in render_plan(plan).splitlines() if "| ml.g5.2xlarge |" in line]
    assert len(md_rows) == 1 and "| ERROR |" in md_rows[0] and "| yes |" not in md_rows[0]

    odd = load_config(None, {**cfg.to_dict(), "batch_size": 30})
    rows = _rows(make_plan(odd, PlanOptions(instances=("g5.12xlarge",), model_memory_gib=8.0, dataset_size=1000)))
    assert "not divisible by 4 processes" in rows["g5.12xlarge"]["errors"][0] and not rows["g5.12xlarge"]["fits"]
    assert verdict(rows["g5.12xlarge"]) == "ERROR"

    plan = make_plan(cfg, PlanOptions(instances=TYPES, model_memory_gib=100.0, dataset_size=1000))
    assert not any(r["fits"] for r in plan["rows"]) and "none of the 4 types planned" in plan["flags"][0]
    assert {verdict(r) for r in plan["rows"]} == {"no"}  # memory alone: "no", the note says how much
    assert all("run_hours" not in r for r in plan["rows"])  # no throughput known: no time, no cost
    assert "unknown: give --images-per-second" in plan["rows"][0]["throughput_source"]


def test_predicted_memory_and_estimated_throughput_without_a_probe(cfg):
    plan = make_plan(cfg, PlanOptions(instances=("g5.xlarge", "g5.12xlarge")))  # dataset counted from data_dir
    rows = _rows(plan)
    assert plan["dataset_size"] == 300 and plan["dataset_source"].startswith("scanned")
    for r in rows.values():
        assert r["memory_source"].startswith("predicted") and 0.5 < r["memory_per_gpu_gib"] < 2
        assert r["throughput_source"].startswith("estimate") and r["images_per_s"] > 0 and r["fits"]
    assert rows["g5.xlarge"]["micro_batch"] == 64 and rows["g5.12xlarge"]["micro_batch"] == 16


def test_predicted_memory_adds_the_cuda_context_of_each_rows_gpu(cfg):
    """The prediction is made without a context and cached per (micro-batch, precision, DDP); each row adds its
    GPU's context from the catalog: the H100's measured 771 MiB, the A10G's and A100's assumed 800 MiB."""
    contexts = []

    def predict(cfg, micro, **kw):
        contexts.append(kw["context_bytes"])
        return MemoryPrediction(micro, (32, 32), "bf16-mixed", kw["world_size"], GIB, GIB, 0, kw["context_bytes"])

    opts = PlanOptions(instances=("g5.xlarge", "p4d.24xlarge", "p5.48xlarge"))
    rows = _rows(make_plan(cfg, opts, predict=predict))
    assert set(contexts) == {0}
    for name, mib, source in (
        ("g5.xlarge", 800, "ASSUMED"),
        ("p4d.24xlarge", 800, "ASSUMED"),
        ("p5.48xlarge", 771, "measured"),
    ):
        assert rows[name]["memory_per_gpu_gib"] == pytest.approx(1 + mib / 1024)
        assert rows[name]["cuda_context_mib"] == mib and rows[name]["cuda_context_source"].startswith(source)


def test_detection_plan_predicts_dino_memory_at_its_largest_input(shared_data):
    """No --model-memory-gib: plan builds the task's model (DINO here) under fake tensors at Task.input_size, the
    largest batch as the collate pads it (64 x 96 px rounded up to pad_to_multiple 64: 64 x 128)."""
    from test_detection import TINY

    det = load_config(
        None, dict(TINY, task="detection", data_dir=str(shared_data / "facemask-coco"), batch_size=2, epochs=1)
    )
    plan = make_plan(det, PlanOptions(instances=("ml.g5.2xlarge",), dataset_size=100, num_classes=2))
    row = _rows(plan)["ml.g5.2xlarge"]
    assert plan["model"] == "detection resnet18 at 64x128 px" and plan["image_size"] == [64, 128]
    assert row["memory_source"] == "predicted (bf16-mixed, trainer/planning/memory.py)" and row["fits"]
    assert 0.6 < row["memory_per_gpu_gib"] < 1.5  # a tiny DINO: mostly the A10G's (assumed) 800 MiB CUDA context
    # DINO's speed does not follow its FLOPs (gathers, matching on the host): no time or cost is invented.
    assert "images_per_s" not in row and row["throughput_source"].startswith("unknown: detection speed")
    timed = make_plan(
        det,
        PlanOptions(
            instances=("ml.g5.2xlarge",), dataset_size=100, num_classes=2, images_per_second=2.0, throughput_gpu="A10G"
        ),
    )
    assert _rows(timed)["ml.g5.2xlarge"]["images_per_s"] == 2.0


def test_cuda_probe_report_sets_memory_and_throughput(cfg, tmp_path):
    """A report as probe writes it on an A10G (figures invented for the test, shape real)."""
    report = {
        "device": "cuda",
        "device_name": "NVIDIA A10G",
        "image_size": 32,
        "config": cfg.to_dict(),
        "best_batch": 64,
        "best_images_per_s": 1000.0,
        "measurements": [{"batch": 64, "peak_bytes": 3 * 2**30, "reserved_bytes": 4 * 2**30, "oom": False}],
    }
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(report))
    rows = _rows(make_plan(cfg, PlanOptions(instances=("g5.xlarge", "p4d.24xlarge"), probe_report=str(path))))
    assert rows["g5.xlarge"]["memory_per_gpu_gib"] == 4.0 and rows["g5.xlarge"]["images_per_s"] == 1000.0
    assert rows["g5.xlarge"]["memory_source"].startswith("probe")
    ratio = catalog.GPU_MODELS["A100"].relative_throughput / catalog.GPU_MODELS["A10G"].relative_throughput
    assert rows["p4d.24xlarge"]["images_per_s"] == pytest.approx(1000.0 * ratio * 8 * 0.9, rel=1e-9)
    assert rows["p4d.24xlarge"]["memory_source"].startswith("predicted")  # other GPU model: predicted
    assert gpu_model_of("NVIDIA A100-SXM4-40GB") == "A100" and gpu_model_of("NVIDIA H200") is None


def test_price_file_overrides_catalog_prices(cfg, tmp_path):
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"g5.2xlarge": {"spot": 0.5}}))
    rows = _rows(
        make_plan(
            cfg,
            PlanOptions(
                instances=("g5.2xlarge",),
                prices=str(prices),
                model_memory_gib=1.0,
                images_per_second=50.0,
                dataset_size=1000,
            ),
        )
    )
    assert rows["g5.2xlarge"]["spot_usd_per_hour"] == 0.5 and not rows["g5.2xlarge"]["spot_is_estimate"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--instances", "g9.huge"], "unknown instance type 'g9.huge'"),
        (["--batch-size", "0"], "batch_size: got 0"),
        (["--batch-size", "4096"], "larger than the dataset (300 training images)"),
        (["--probe-report", "/nonexistent/probe.json"], "does not exist"),
        (["--probe-report", "CORRUPT"], "is not a readable JSON file"),
        (["--probe-report", "NOT_A_PROBE"], "lacks the probe's keys"),
        (["--prices", "CORRUPT"], "is not valid JSON"),
        (["--platform", "gcp"], "--platform: got 'gcp'"),
        (["--margin", "1.5"], "--margin"),
        (["--out", "A_FILE/plan.json"], "cannot create its folder"),
        (["--out", "."], "is a folder"),
    ],
)
def test_errors_exit_2_with_one_line(cfg, tmp_path, capsys, args, message):
    (tmp_path / "corrupt.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"epoch": 3}')
    (tmp_path / "a_file").write_text("keep me")
    args = [
        a.replace("CORRUPT", str(tmp_path / "corrupt.json"))
        .replace("NOT_A_PROBE", str(tmp_path / "other.json"))
        .replace("A_FILE", str(tmp_path / "a_file"))
        for a in args
    ]
    assert (
        main(
            [
                "plan",
                "--data-dir",
                cfg.data_dir,
                "--model",
                "resnet18",
                "--image-size",
                "32",
                "--model-memory-gib",
                "1",
                *args,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and message in err


def test_plan_cli_writes_json(cfg, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--data-dir",
                cfg.data_dir,
                "--model",
                "resnet18",
                "--image-size",
                "32",
                "--batch-size",
                "64",
                "--instances",
                "g5.2xlarge,ml.g5.2xlarge",
                "--nproc-per-node",
                "2",
                "--model-memory-gib",
                "4",
                "--images-per-second",
                "200",
                "--throughput-gpu",
                "A10G",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    plan = json.loads(out.read_text())
    assert {r["instance"] for r in plan["rows"]} == {"g5.2xlarge", "ml.g5.2xlarge"}
    stdout = capsys.readouterr().out
    assert "ERROR: --nproc-per-node 2 on ml.g5.2xlarge, which has 1 GPU(s)" in stdout and "plan took" in stdout
    row = next(line for line in stdout.splitlines() if "| ml.g5.2xlarge |" in line)
    assert "| ERROR |" in row and "| yes |" not in row  # never "fits: yes" beside an ERROR
    assert not next(r for r in plan["rows"] if r["instance"] == "ml.g5.2xlarge")["fits"]
    with pytest.raises(PlanError):
        PlanOptions(throughput_gpu="TPU").validate()
