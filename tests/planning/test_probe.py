"""probe: doubling + bisection search, and the command end to end on CPU with a simulated memory limit."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.cli import main
from trainer.config import ConfigError
from trainer.planning.options import ProbeOptions
from trainer.planning.step_probe import StepMeasurement, search_batch


def _limit_at(limit: int):
    calls = []

    def measure(b: int) -> StepMeasurement:
        calls.append(b)
        return StepMeasurement(b, peak_bytes=b, oom=b > limit * 1.2, fits=b <= limit)

    return measure, calls


def test_search_doubles_then_bisects_to_the_granularity():
    measure, calls = _limit_at(40)
    best, taken = search_batch(measure, 4, 1024, 4)
    assert calls == [4, 8, 16, 32, 64, 48, 40, 44]
    assert best == 40 and [m.batch for m in taken] == calls
    assert taken[4].oom and not taken[5].oom and not taken[5].fits  # 64 OOMs, 48 only exceeds the margin


def test_search_edge_cases():
    measure, calls = _limit_at(1000)
    assert search_batch(measure, 4, 100, 4)[0] == 64 and calls == [4, 8, 16, 32, 64]  # max_batch reached
    measure, calls = _limit_at(2)
    assert search_batch(measure, 4, 100, 4)[0] is None and calls == [4]  # nothing fits
    measure, _ = _limit_at(37)
    assert search_batch(measure, 4, 1024, 1)[0] == 37  # granularity 1: exact


@pytest.mark.parametrize(
    "bad",
    [
        dict(start_batch=0),
        dict(start_batch=64, max_batch=8),
        dict(margin=1.0),
        dict(memory_limit_gib=0),
        dict(workers=(-1,)),
    ],
)
def test_probe_options_are_validated(bad):
    with pytest.raises(ConfigError):
        ProbeOptions(**bad).validate()


def test_probe_command_end_to_end_with_a_simulated_limit(tiny_digits, tmp_path, capsys):
    """ResNet-18 at 64 px, fp32 on CPU: peaks measured on CPU-2 are ~187 MiB at batch 32 and ~240 MiB at 64, so
    a 0.21875 GiB (224 MiB) limit with a 10 % margin (201.6 MiB) fits 32, OOMs at 64 and rejects 48."""
    out = tmp_path / "probe"
    cmd = [
        "probe",
        "--data-dir",
        str(tiny_digits),
        "--model",
        "resnet18",
        "--image-size",
        "64",
        "--device",
        "cpu",
        "--precision",
        "32",
        "--num-workers",
        "1",
        "--memory-limit-gib",
        "0.21875",
        "--start-batch",
        "8",
        "--max-batch",
        "256",
        "--granularity",
        "16",
        "--steps",
        "1",
        "--workers",
        "0,1",
        "--prefetch",
        "2",
        "--loader-batches",
        "3",
        "--out-dir",
        str(out),
    ]
    # oneDNN off: its convolution temporaries are CPU-model dependent (on an AMD EPYC VM they pushed batch 32 over
    # this limit, on an Intel Xeon not); without them the peaks, and so the search below, are the same everywhere.
    with torch.backends.mkldnn.flags(enabled=False):
        assert main(cmd) == 0  # in process: the CLI path without a second torch import
    r = json.loads((out / "probe.json").read_text())
    batches = [m["batch"] for m in r["measurements"]]
    assert batches[:4] == [8, 16, 32, 64]  # doubling until the first failure
    assert r["measurements"][3]["oom"] and "simulated OOM" in r["measurements"][3]["note"]
    assert all(32 < b < 64 for b in batches[4:]) and batches[4:]  # then bisection inside (32, 64)
    assert r["best_batch"] == 32
    fits = {m["batch"]: m["fits"] for m in r["measurements"]}
    assert fits[32] and not any(fits[b] for b in batches if b > 32)
    assert all(m["peak_bytes"] > 0 and m["step_s"] > 0 for m in r["measurements"] if not m["oom"])
    assert r["limit_bytes"] == 0.21875 * 2**30 and r["device"] == "cpu" and r["precision"] == "fp32"
    assert {(x["num_workers"], x["prefetch_factor"]) for x in r["loader"]} == {(0, 2), (1, 2)}
    assert all(x["images_per_s"] > 0 for x in r["loader"])
    one = next(x for x in r["loader"] if x["num_workers"] == 1)
    assert one["worker_server_bytes"] > 100 * 2**20 and one["workers_private_bytes"] > 0  # torch imported there
    assert r["loader_ram_prediction"]["worker_server_bytes"] == one["worker_server_bytes"]
    assert r["loader_ram_prediction"]["bytes_per_sample"] == 3 * 64 * 64  # decoded uint8 sample, measured
    assert r["gpu_waits_on_data"] in (True, False) and "images/s" in r["data_verdict"]
    md = (out / "probe.md").read_text()
    assert "largest batch per device that fits with the margin: 32" in md and "| 64 |" in md
    assert (out / "probe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the plan reads this report, and says that a CPU probe's figures are not GPU figures
    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                "--data-dir",
                str(tiny_digits),
                "--model",
                "resnet18",
                "--image-size",
                "64",
                "--batch-size",
                "64",
                "--epochs",
                "2",
                "--instances",
                "g5.xlarge",
                "--probe-report",
                str(out / "probe.json"),
            ]
        )
        == 0
    )
    stdout = capsys.readouterr().out
    assert "probe report from a cpu run" in stdout and "| g5.xlarge |" in stdout


def test_loader_probe_times_the_device_side_of_gpu_decoding(shared_data):
    from trainer.config import TrainConfig
    from trainer.data.formats.device_jpeg import collate_encoded, decode_on_device
    from trainer.data.formats.imagefolder import ImageFolderDataset, scan_split
    from trainer.data.transforms import train_transform
    from trainer.planning.loader_probe import measure_loader

    scan = scan_split(shared_data / "hymenoptera", "val")
    ds = ImageFolderDataset(scan, lambda e: train_transform(64, 0.08, 0.5), decode_device="cuda")
    shapes = []
    r = measure_loader(
        ds,
        collate_encoded,
        TrainConfig(),
        8,
        0,
        2,
        3,
        device_side=lambda b: shapes.append(tuple(decode_on_device(b, torch.device("cpu"))[0].shape)),
    )
    assert shapes == [(8, 3, 64, 64)] * 3 and r["includes_device_side"] and r["images_per_s"] > 0
    assert 5_000 < r["bytes_per_sample"] < 500_000  # encoded JPEG bytes, not a decoded 64 px image
