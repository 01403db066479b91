"""The prepared GPU call, checked on the CPU: what ``benchmarks/gpu_carry.py`` counts as travelling (the
device takes 64 MiB in all), its pins, the steps ``benchmarks/gpu_prepared_run.sh`` runs (its four figures,
every name one that ``gpu_dino.sh`` / ``gpu_suite.py`` has) and the summary table's goals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_carry  # noqa: E402
import gpu_prepared_run  # noqa: E402
import gpu_suite  # noqa: E402

IGNORE = "/.gpu-carry/\n/scratch/\n"


def _git_repo(root: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text(IGNORE)
    (root / "tracked.py").write_bytes(b"x" * 1000)
    subprocess.run(["git", "-C", str(root), "add", "tracked.py", ".gitignore"], check=True)
    (root / "untracked.txt").write_bytes(b"y" * 500)  # not ignored: travels
    (root / "scratch").mkdir()
    (root / "scratch" / "big.bin").write_bytes(b"z" * 10_000)  # ignored, not carried: stays
    (root / "link").symlink_to("/usr")  # travels as a link, never what it points to
    carry = root / ".gpu-carry"
    (carry / "whl").mkdir(parents=True)
    (carry / "whl" / "a.whl").write_bytes(b"w" * 2000)
    (carry / "data.bin").write_bytes(b"d" * 1000)
    return carry


def test_account_counts_the_tree_and_the_carried_folder_only(tmp_path):
    _git_repo(tmp_path)
    acc = gpu_carry.account(tmp_path, [Path(".gpu-carry")], limit_mib=1)
    tree = 1000 + 500 + len(IGNORE) + len("/usr")
    assert acc["tree"] == tree
    assert acc["carried"] == {".gpu-carry": 3000}
    assert acc["total"] == tree + 3000 and acc["fits"]
    assert not gpu_carry.account(tmp_path, [Path(".gpu-carry")], limit_mib=tree / 2**20)["fits"]


def test_a_carried_path_git_does_not_ignore_is_refused(tmp_path):
    _git_repo(tmp_path)
    with pytest.raises(gpu_carry.CarryError, match="untracked.txt is not ignored"):
        gpu_carry.account(tmp_path, [Path("untracked.txt")])


def test_over_the_limit_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    _git_repo(tmp_path)
    monkeypatch.setattr(gpu_carry, "ROOT", tmp_path)
    assert gpu_carry.main(["--check", "--limit-mib", "0.001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "over the 0.001 MiB" in err[0], err
    assert gpu_carry.main(["--check"]) == 0
    assert "total travelling: 0.00 MiB of 64 MiB" in capsys.readouterr().out
    monkeypatch.setattr(gpu_carry, "ROOT", tmp_path / "nowhere")
    assert gpu_carry.main(["--check"]) == 2


def test_pins_come_from_the_requirements_files(tmp_path):
    ffcv = gpu_carry.pins(gpu_carry.FFCV_PINS, ROOT / "requirements-ffcv.txt")
    assert ffcv[0] == "ffcv==1.0.2" and len(ffcv) == len(gpu_carry.FFCV_PINS)
    trainer = gpu_carry.pins(gpu_carry.TRAINER_PINS, ROOT / "requirements-trainer.txt")
    assert "torch-linear-assignment==0.1.0" in trainer
    req = tmp_path / "req.txt"
    req.write_text("fastargs>=1\n")
    with pytest.raises(gpu_carry.CarryError, match="req.txt: no '==' pin for fastargs"):
        gpu_carry.pins(("fastargs",), req)


def test_the_prepared_run_covers_its_four_figures_with_existing_step_names(tmp_path):
    dino = gpu_prepared_run.dino_steps_in_script()
    assert set(gpu_prepared_run.DINO_STEPS) <= set(dino), set(gpu_prepared_run.DINO_STEPS) - set(dino)
    assert set(gpu_prepared_run.dino_skip()) | set(gpu_prepared_run.DINO_STEPS) == set(dino)
    assert "build" not in gpu_prepared_run.dino_skip()  # the op is built when the carried build does not load
    suite = [name for name, _, _ in gpu_suite.plan("cuda", False, tmp_path, tmp_path / "work")]
    assert set(gpu_prepared_run.SUITE_STEPS) <= set(suite), set(gpu_prepared_run.SUITE_STEPS) - set(suite)
    assert suite.index("jpeg_copies") < suite.index("speed_decode_cuda") < suite.index("ffcv_write")
    assert suite.index("ffcv_write") < suite.index("speed_ffcv")
    # 1: graphs and the batched matcher on the real loop; 2: decode beside the in-memory rate; 3; 4
    assert {r for r, _, _ in gpu_prepared_run.DINO_RUNS} <= set(gpu_prepared_run.DINO_STEPS)
    assert {"speed_classification", "speed_decode_cuda", "checkpoint", "speed_ffcv"} <= set(
        gpu_prepared_run.SUITE_STEPS
    )
    script = (ROOT / "benchmarks" / "gpu_prepared_run.sh").read_text()
    assert "--steps dino-skip" in script and "--steps suite" in script and "gpu_carry.py" in script


def test_the_suite_asks_only_for_the_datasets_its_steps_read(tmp_path, capsys):
    (tmp_path / "imagenette-subset").mkdir()
    steps = [s for s in gpu_suite.plan("cuda", False, tmp_path, tmp_path / "w") if s[0] in gpu_prepared_run.SUITE_STEPS]
    assert gpu_suite.needed_datasets(steps, tmp_path) == []
    everything = gpu_suite.plan("cuda", False, tmp_path, tmp_path / "w")
    assert gpu_suite.needed_datasets(everything, tmp_path) == ["rid-roofs", "video-clips"]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _dino_run(d: Path, run: str, steps: list, epoch_rate: float, busy: float, synth: str, ms: float) -> None:
    """Fake gpu_dino.sh output of one real-loop run (cumulative step lines, the epoch line, gpu_busy.py's line) and
    of the synthetic step it is compared with."""
    lines = [f"step={s} loss=1 images_per_s={r}" for s, r in steps]
    lines.append(f"epoch=1 step={steps[-1][0]} lr=0 train_loss=1 images_per_s={epoch_rate} epoch_time_s=10")
    _write(d / f"{run}.log", "\n".join(lines) + "\n")
    _write(d / f"{run}.busy", f"busy {busy} % over the epoch (20 samples); 40.0 % over the whole run (60 samples)")
    _write(d / f"{synth}.log", f"timed: batch=2 ms_per_step={ms} images_per_s=1.0\n")


def test_the_summary_sets_each_figure_beside_its_goal(tmp_path):
    d = tmp_path / "dino"
    # eager: 2 * (150 - 80) / (150 * 2 / 20 - 80 * 2 / 18) = 22.9 images/s over the second half: goal missed
    _dino_run(d, "dino_train_static", [(20, 10.0), (80, 18.0), (150, 20.0)], 20.01, 52.2, "dino_step_static", 107.0)
    # graphs: 2 * 75 / (150 * 2 / 30 - 75 * 2 / 30) = 30 images/s, 66.7 ms/step = 1.11x a 60 ms synthetic step
    _dino_run(d, "dino_train_static_graphs", [(75, 30.0), (150, 30.0)], 28.5, 75.0, "dino_step_graphs", 60.0)
    _write(d / "graphs_tests.log", "3 passed in 20.1s\n")
    _write(
        tmp_path / "suite" / "gpu_suite.md",
        "| figure | value | step (log) |\n| --- | --- | --- |\n"
        "| classification resnet50 224 px batch 256 bf16-mixed: samples/s | 4,000.0 / 3,990.0 (ratio 1.0025) "
        "| speed_classification |\n"
        "| decode cuda images/s (last epoch) | 3,700.0 (0.925 of the in-memory trainer) | speed_decode_cuda |\n"
        "| periodic checkpoint cost (steps) | 1.42 | checkpoint |\n"
        "| ffcv resnet50 224 px batch 256 bf16-mixed: trainer / bare loop | 3,000.0 / 3,050.0 (ratio 0.9836) "
        "| speed_ffcv |\n",
    )
    rows = {ln.split("|")[-2].strip(): ln for ln in gpu_prepared_run.summary(tmp_path)[2:]}
    assert "20.01 images/s over the epoch, 22.91 over its second half; busy 52.2 %" in rows["dino_train_static"]
    assert "0.82 x the synthetic step (107.0 ms" in rows["dino_train_static"]
    assert rows["dino_train_static"].rstrip().endswith("| no | dino_train_static |")
    assert (
        "30.00 over its second half" in rows["dino_train_static_graphs"]
        and "1.11 x" in rows["dino_train_static_graphs"]
    )
    assert "| **yes** |" in rows["dino_train_static_graphs"]
    assert "| not run |" in rows["dino_train_static_batched_matcher"]
    assert "| — | dino_train_static_batched_matcher |" in rows["dino_train_static_batched_matcher"]
    assert "| 3 passed | pass | **yes** |" in rows["graphs_tests"] and "| not run |" in rows["matcher_tests"]
    assert "| >= 0.9x in-memory | **yes** |" in rows["speed_decode_cuda"]
    assert "| 1.42 | <= 1 step | no |" in rows["checkpoint"]
    assert "| >= 0.98 (trainer / bare loop) | **yes** |" in rows["speed_ffcv"]
    assert "4,000.0 / 3,990.0" in rows["speed_classification"]


def test_the_summary_says_not_run_for_a_missing_suite(tmp_path):
    rows = gpu_prepared_run.summary(tmp_path)
    assert any("| 4 FFCV | speed_ffcv | not run |" in r for r in rows), rows
    assert gpu_prepared_run.main(["--summary", str(tmp_path / "absent")]) == 2


def test_the_carried_op_is_keyed_by_its_sources(tmp_path, monkeypatch):
    """The run copies the carried op in place only when ``--op-sha`` there equals its SOURCES.sha256."""
    msda = tmp_path / "trainer" / "ops" / "msda"
    (msda / "csrc").mkdir(parents=True)
    (msda / "csrc" / "msda_kernel.cu").write_text("__global__ void k() {}\n")
    (msda / "build.py").write_text("# build\n")
    monkeypatch.setattr(gpu_carry, "ROOT", tmp_path)
    before = gpu_carry.op_sources_sha()
    assert gpu_carry.op_sources_sha() == before
    (msda / "csrc" / "msda_kernel.cu").write_text("__global__ void k() { }\n")
    assert gpu_carry.op_sources_sha() != before
    script = (ROOT / "benchmarks" / "gpu_prepared_run.sh").read_text()
    assert "gpu_carry.py --op-sha" in script and "SOURCES.sha256" in script


def test_an_interpreter_that_does_not_run_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    _git_repo(tmp_path)
    monkeypatch.setattr(gpu_carry, "ROOT", tmp_path)
    assert gpu_carry.main(["--python", str(tmp_path / "python3.12"), "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python3.12 does not run; a CPython 3.12 interpreter is needed" in err[0], err
    assert gpu_carry.main(["--python", sys.executable, "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    if sys.version_info[:2] != (3, 12):
        assert f"is Python {sys.version_info[0]}.{sys.version_info[1]}; the GPU machine's python3 is 3.12" in err
    else:
        assert "lacks facemask-coco, imagenette-subset" in err


def test_a_chosen_data_folder_need_not_hold_every_shared_dataset(tmp_path):
    """On the GPU machine ``TRAINSTACK_DATA`` names the carried datasets (no hymenoptera): the CUDA tests that read
    facemask-coco run; the default folder still has to hold the whole set."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("conftest_under_test", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    (tmp_path / "facemask-coco").mkdir()
    assert conftest.shared_data_problem(tmp_path, chosen=True) is None
    assert "shared datasets not found at" in conftest.shared_data_problem(tmp_path, chosen=False)
    assert "not found" in conftest.shared_data_problem(tmp_path / "absent", chosen=True)
    (tmp_path / "hymenoptera").mkdir()
    assert conftest.shared_data_problem(tmp_path, chosen=False) is None
