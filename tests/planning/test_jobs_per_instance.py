"""plan --jobs-per-instance K: K jobs share one instance's GPUs (split or time-sliced), host RAM and vCPUs; the
configurations that exhaust the host are ERROR rows (seed 004: 4 jobs x batch 16 on g5.2xlarge made the instance
unresponsive, 2-3 were fine)."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_overrides

from trainer.cli import main
from trainer.config import load_config
from trainer.planning.host_ram import (
    CUDA_PROCESS_HOST_BYTES,
    GIB,
    MIB,
    WORKER_OVERHEAD_BYTES,
    WORKER_SERVER_BYTES,
    pinned_block_bytes,
    predict_host_ram,
)
from trainer.planning.options import PlanError, PlanOptions
from trainer.planning.plan import make_plan, render_plan, verdict
from trainer.tasks.classification.task import ClassificationTask

CLIP_BYTES = 32 * 3 * 64 * 64  # seed 004: 32 frames x 3 x 64 x 64 uint8
NPZ_BYTES = 10_000 * CLIP_BYTES  # its 10,000 clips decompressed from an .npz in every training process


def _cfg(tmp_path, **extra):
    return load_config(None, tiny_overrides(tmp_path, tmp_path, **extra))


def _row(cfg, **opts):
    base = dict(model_memory_gib=4.0, images_per_second=100.0, throughput_gpu="A10G", dataset_size=8000)
    plan = make_plan(cfg, PlanOptions(**{**base, **opts}))
    return plan, {r["instance"]: r for r in plan["rows"]}


def test_one_job_keeps_the_plan_and_reports_host_figures(tmp_path):
    cfg = _cfg(tmp_path, batch_size=64, num_workers=2)
    plan, rows = _row(cfg, instances=("g5.2xlarge",))
    r = rows["g5.2xlarge"]
    assert plan["jobs_per_instance"] == 1 and "jobs_per_instance" not in r and verdict(r) == "yes"
    assert r["memory_per_gpu_gib"] == 4.0 and r["images_per_s"] == 100.0 and not r["warnings"]
    assert r["busy_processes"] == 3 and r["host_ram"]["jobs"] == 1
    assert r["host_ram"]["process_bytes"] == CUDA_PROCESS_HOST_BYTES
    md = render_plan(plan)
    assert "jobs per instance" not in md and "host RAM" not in md  # one job: today's table


def test_jobs_on_one_gpu_multiply_its_memory_and_divide_its_speed(tmp_path):
    cfg = _cfg(tmp_path, batch_size=64, num_workers=1)
    _, one = _row(cfg, instances=("g5.2xlarge", "g5.12xlarge"))
    _, two = _row(cfg, instances=("g5.2xlarge", "g5.12xlarge"), jobs_per_instance=2)
    a, b = one["g5.2xlarge"], two["g5.2xlarge"]
    assert b["memory_per_gpu_gib"] == 2 * a["memory_per_gpu_gib"] and b["jobs_per_gpu"] == 2
    assert b["images_per_s"] == pytest.approx(a["images_per_s"] / 2) and b["run_hours"] == pytest.approx(
        2 * a["run_hours"]
    )
    assert "time-slice" in b["warnings"][0] and "/ 2 jobs per GPU" in b["throughput_source"]
    assert b["run_usd_per_job_on_demand"] == pytest.approx(b["run_usd_on_demand"] / 2)
    assert b["host_ram"]["total_bytes"] == 2 * a["host_ram"]["total_bytes"] and verdict(b) == "yes"
    # 4 GPUs, 2 jobs: 2 GPUs (processes) each, the batch split per job, memory per GPU unchanged.
    c = two["g5.12xlarge"]
    assert c["processes_per_job"] == 2 and c["micro_batch"] == 32 and c["jobs_per_gpu"] == 1
    assert c["images_per_s"] == pytest.approx(100.0 * 2 * 0.9) and c["memory_per_gpu_gib"] == 4.0
    # 4 GPUs, 3 jobs: one GPU each, one idle; 6 jobs: 2 per GPU on the busiest, uneven.
    _, three = _row(cfg, instances=("g5.12xlarge",), jobs_per_instance=3)
    assert (
        three["g5.12xlarge"]["processes_per_job"] == 1 and "leave 1 GPU(s) idle" in three["g5.12xlarge"]["warnings"][0]
    )
    _, six = _row(cfg, instances=("g5.12xlarge",), jobs_per_instance=6)
    assert six["g5.12xlarge"]["jobs_per_gpu"] == 2 and six["g5.12xlarge"]["memory_per_gpu_gib"] == 8.0
    assert any("do not spread evenly" in w for w in six["g5.12xlarge"]["warnings"])


def test_indivisible_batch_per_job_and_nproc_per_job(tmp_path):
    cfg = _cfg(tmp_path, batch_size=31, num_workers=0)
    _, rows = _row(cfg, instances=("g5.12xlarge",), jobs_per_instance=2)
    assert "not divisible by 2 processes per job" in rows["g5.12xlarge"]["errors"][0]
    _, rows = _row(_cfg(tmp_path, batch_size=32), instances=("g5.12xlarge",), jobs_per_instance=2, nproc_per_node=4)
    assert "each job has 2 GPU(s); use 2" in rows["g5.12xlarge"]["errors"][0]


def test_jobs_beyond_the_vcpus_are_an_error(tmp_path):
    cfg = _cfg(tmp_path, batch_size=16, num_workers=4)
    plan, rows = _row(cfg, instances=("g5.2xlarge", "g5.8xlarge"), jobs_per_instance=2)
    r = rows["g5.2xlarge"]  # 2 jobs x (1 main + 4 workers) = 10 busy processes on 8 - 1 vCPUs
    assert r["busy_processes"] == 10 and r["vcpus_for_jobs"] == 7 and not r["fits"] and verdict(r) == "ERROR"
    assert "--jobs-per-instance 2: 10 busy processes" in r["errors"][0] and "vCPUs" in r["errors"][0]
    assert rows["g5.8xlarge"]["fits"]  # 32 vCPUs
    assert plan["rows"][-1]["instance"] == "g5.2xlarge"
    md_row = next(line for line in render_plan(plan).splitlines() if "| g5.2xlarge |" in line)
    assert "| ERROR |" in md_row and "| 10 / 8 |" in md_row


def test_jobs_beyond_the_host_ram_are_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(ClassificationTask, "host_data_bytes", lambda self, data, n=None: (10 * GIB, 0))
    cfg = _cfg(tmp_path, batch_size=16, num_workers=0)
    _, rows = _row(cfg, instances=("g5.2xlarge",), jobs_per_instance=3)
    r = rows["g5.2xlarge"]  # 3 x (3 GiB process + 10 GiB dataset + loader) > 32 GiB x 0.9
    assert r["host_ram_need_gib"] > 39 and verdict(r) == "ERROR" and len(r["errors"]) == 1
    assert r["errors"][0].startswith("--jobs-per-instance 3: host RAM") and "minus 10% margin" in r["errors"][0]
    _, rows = _row(cfg, instances=("g5.2xlarge",))  # one job of 13 GiB fits
    assert verdict(rows["g5.2xlarge"]) == "yes"
    monkeypatch.setattr(ClassificationTask, "host_data_bytes", lambda self, data, n=None: (40 * GIB, 0))
    _, rows = _row(cfg, instances=("g5.2xlarge",))  # one job over the RAM: a warning, as before the flag
    assert verdict(rows["g5.2xlarge"]) == "yes" and rows["g5.2xlarge"]["warnings"][0].startswith("host RAM")


def test_plan_json_carries_the_components_and_a_probe_measured_process(tmp_path, monkeypatch):
    monkeypatch.setattr(ClassificationTask, "host_data_bytes", lambda self, data, n=None: (GIB, 2 * GIB))
    cfg = _cfg(tmp_path, batch_size=16, num_workers=2)
    probe = {
        "device": "cuda",
        "device_name": "NVIDIA A10G",
        "image_size": "32x32",
        "config": cfg.to_dict(),
        "best_batch": 64,
        "best_images_per_s": 100.0,
        "measurements": [],
        "host_rss_hwm_bytes": 5 * GIB,
        "host_data_bytes_per_process": GIB,
        "loader_ram_prediction": {"worker_overhead_bytes": 40 * MIB, "worker_overhead_source": "measured (probe)"},
    }
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe))
    plan, rows = _row(cfg, instances=("g5.2xlarge",), jobs_per_instance=2, probe_report=str(path))
    ram = json.loads(json.dumps(plan))["rows"][0]["host_ram"]
    assert ram["process_bytes"] == 4 * GIB and ram["process_source"].startswith("measured (probe VmHWM on NVIDIA")
    assert ram["dataset_bytes"] == GIB and ram["page_cache_bytes"] == 2 * GIB
    assert ram["loader"]["worker_overhead_bytes"] == 40 * MIB and ram["idle_eval_workers_bytes"] == 80 * MIB
    assert (
        ram["total_bytes"] == 2 * ram["per_job_bytes"] and ram["with_page_cache_bytes"] == ram["total_bytes"] + 2 * GIB
    )
    assert "host RAM per process: process 4.00 (measured)" in render_plan(plan)


def test_pinned_memory_follows_the_loader_and_the_host_allocator():
    assert pinned_block_bytes(6 * MIB) == 8 * MIB and pinned_block_bytes(8 * MIB) == 8 * MIB
    kw = dict(micro_batch=16, bytes_per_sample=CLIP_BYTES, prefetch_factor=2)
    ram = predict_host_ram(num_workers=3, **kw)  # 6 batches pinned: 8 MiB training + 16 MiB evaluation blocks
    assert ram.pinned_bytes == 6 * (8 + 16) * MIB and ram.loader.buffer_bytes == 6 * 16 * CLIP_BYTES
    assert ram.idle_eval_workers_bytes == 3 * WORKER_OVERHEAD_BYTES
    assert predict_host_ram(num_workers=0, **kw).pinned_bytes == 24 * MIB  # the loop pins its one batch
    assert predict_host_ram(num_workers=3, pin_memory=False, **kw).pinned_bytes == 0
    assert predict_host_ram(num_workers=3, device_type="cpu", **kw).pinned_bytes == 0
    with pytest.raises(ValueError):
        predict_host_ram(num_workers=1, jobs=0, **kw)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_jobs_per_instance_below_one_exits_2_with_one_line(tmp_path, capsys, value):
    args = ["plan", "--data-dir", str(tmp_path), "--model-memory-gib", "1", "--dataset-size", "100"]
    assert main([*args, "--jobs-per-instance", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: --jobs-per-instance: got {value}")
    with pytest.raises(PlanError, match="--jobs-per-instance"):
        PlanOptions(jobs_per_instance=0).validate()


def test_seed_004_four_jobs_of_batch_16_exhaust_a_g5_2xlarge(tmp_path, monkeypatch):
    """Seed 004's shape: 10,000 clips of 32 x 64 x 64 x 3 uint8 decompressed from an .npz in every job, batch 16,
    one loader worker, one A10G, 8 vCPUs, 32 GiB. K = 2 and 3 run; K = 4 is an ERROR (its 8 busy processes
    exceed the 7 vCPUs left after the OS), and its jobs no longer leave room for the page cache."""
    monkeypatch.setattr(ClassificationTask, "loader_sample_bytes", lambda self, train=True: CLIP_BYTES)
    monkeypatch.setattr(ClassificationTask, "host_data_bytes", lambda self, data, n=None: (NPZ_BYTES, NPZ_BYTES))
    cfg = _cfg(tmp_path, batch_size=16, num_workers=1, epochs=30)
    got = {}
    for k in (1, 2, 3, 4):
        _, rows = _row(cfg, instances=("g5.2xlarge",), model_memory_gib=0.5, jobs_per_instance=k)
        got[k] = rows["g5.2xlarge"]
    assert [verdict(got[k]) for k in (1, 2, 3, 4)] == ["yes", "yes", "yes", "ERROR"]
    ram = got[4]["host_ram"]
    assert ram["dataset_bytes"] == NPZ_BYTES and ram["process_bytes"] == CUDA_PROCESS_HOST_BYTES
    assert ram["loader"]["buffer_bytes"] == 2 * 16 * CLIP_BYTES and ram["pinned_bytes"] == 2 * (8 + 16) * MIB
    assert ram["loader"]["worker_server_bytes"] == WORKER_SERVER_BYTES  # one fork server per job's process
    assert 7.1 < ram["per_job_bytes"] / GIB < 7.2 and [got[k]["busy_processes"] for k in (1, 2, 3, 4)] == [2, 4, 6, 8]
    assert any("8 busy processes" in e for e in got[4]["errors"])
    assert any(w.startswith("shared page cache 3.7 GiB does not fit") for w in got[4]["warnings"])
    assert not any(w.startswith("shared page cache") for w in got[3]["warnings"])


def test_probe_records_the_process_rss_and_a_cpu_probe_is_not_a_gpu_figure(tiny_digits, tmp_path, capsys):
    out = tmp_path / "probe"
    common = ["--data-dir", str(tiny_digits), "--model", "resnet18", "--image-size", "32", "--device", "cpu"]
    probe = ["--start-batch", "8", "--max-batch", "8", "--steps", "1", "--workers", "0", "--loader-batches", "2"]
    assert main(["probe", *common, "--precision", "32", *probe, "--out-dir", str(out)]) == 0
    r = json.loads((out / "probe.json").read_text())
    assert r["host_rss_hwm_bytes"] >= r["measurements"][0]["rss_hwm_bytes"] > 100 * MIB
    assert r["host_data_bytes_per_process"] == 0 and "Host RAM of this process" in (out / "probe.md").read_text()
    plan_out = tmp_path / "plan.json"
    args = ["--instances", "g5.2xlarge", "--jobs-per-instance", "2", "--num-workers", "1", "--batch-size", "16"]
    assert main(["plan", *common, *args, "--probe-report", str(out / "probe.json"), "--out", str(plan_out)]) == 0
    row = json.loads(plan_out.read_text())["rows"][0]
    assert row["host_ram"]["process_source"].startswith("ASSUMED: CUDA_PROCESS_HOST_BYTES")  # CPU probe: not used
    assert "2 jobs per instance" in capsys.readouterr().out
