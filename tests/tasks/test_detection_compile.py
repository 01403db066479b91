"""compile: true for detection: DINO's encoder and decoder layers are compiled with torch.compile
(Inductor, on the CPU here), the deformable-attention op is one node of their graphs (no graph break), the loss
of a compiled step equals the eager one, and a machine where Inductor cannot run gets one clear line."""

from __future__ import annotations

import pytest
import torch

from tests.tasks.test_detection import TINY
from trainer.config import ConfigError, load_config
from trainer.engine.step import build_single_rank_step

pytestmark = pytest.mark.slow


def _cfg(shared_data, tmp_path, compile_model):
    over = dict(TINY, min_scale=128, max_scale=128, max_size=192, eval_size=128)
    return load_config(
        None,
        dict(
            over,
            task="detection",
            data_dir=str(shared_data / "facemask-coco"),
            optimizer="adamw",
            lr=1e-4,
            gradient_clip=0.1,
            precision="32",
            device="cpu",
            batch_size=2,
            num_workers=0,
            channels_last=False,
            compile=compile_model,
            log_dir=str(tmp_path),
        ),
    )


def test_compiled_layers_train_like_eager_without_graph_breaks(shared_data, tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        rig = build_single_rank_step(_cfg(shared_data, tmp_path, compiled), torch.device("cpu"), 3)
        layers = [*rig.model.transformer.encoder.layers, *rig.model.transformer.decoder.layers]
        assert all((layer._compiled_call_impl is not None) == compiled for layer in layers)
        assert rig.model.backbone._compiled_call_impl is None  # the rest of DINO stays eager
        x = rig.example_batch(2)
        torch.manual_seed(1)  # the same denoising noise in both runs
        losses[compiled] = [float(rig.step(x)) for _ in range(2)]
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 2  # encoder and decoder layers
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-5)


def test_compile_where_inductor_cannot_run_is_one_clear_error(shared_data, tmp_path, monkeypatch):
    import trainer.tasks.detection.task as det

    monkeypatch.setattr(det, "compile_unavailable", lambda device: "no C++ compiler on PATH")
    with pytest.raises(ConfigError, match=r"^compile: no C\+\+ compiler on PATH; train without --compile$"):
        build_single_rank_step(_cfg(shared_data, tmp_path, True), torch.device("cpu"), 3)
