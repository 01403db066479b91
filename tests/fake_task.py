"""A plug-in task that is not classification, for engine tests: regression of y = w·x + b on seeded synthetic data.

Its model step passes the targets into the model's forward (as DINO's contrastive denoising needs), returns two
loss terms, and its evaluator is a gathering one whose metric is best when *lower* (median absolute error), plus a
summed MSE. Registered by the tests as task "regression" (``trainer.tasks.register_task``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from trainer.engine.evaluation import GatherEvaluator
from trainer.tasks.base import StepOutput, Task, TaskData

DIM = 8


class KeyedTensors(torch.utils.data.Dataset):
    """Rows of (x, y) addressed by the engine's ``(epoch, index)`` keys."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=g)
        w = torch.arange(1, DIM + 1, dtype=torch.float32) / DIM
        self.y = self.x @ w + 0.5 + 0.01 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, key):
        _, i = key
        return self.x[i], self.y[i]


def collate(items: list) -> dict:
    return {"x": torch.stack([i[0] for i in items]), "y": torch.stack([i[1] for i in items]), "bad": []}


class TargetAwareLinear(nn.Module):
    """A linear model whose forward takes the targets too (training only), like a denoising detector."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, 1)
        self.seen_targets = 0

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        if targets is not None:
            self.seen_targets += int(targets.shape[0])
        return self.fc(x).squeeze(1)


class MedianErrorEvaluator(GatherEvaluator):
    """Gathers |prediction - target| per sample from every rank: median (lower is better) and MSE."""

    directions = {"median_abs_error": "min", "mse": "min"}

    def records(self, outputs, batch):
        return (outputs.float() - batch["y"]).abs().tolist()

    def metrics(self, records):
        t = torch.tensor(records, dtype=torch.float64)
        return {"median_abs_error": t.median().item(), "mse": (t**2).mean().item(), "count": float(len(records))}


class RegressionTask(Task):
    name = "regression"
    target_metric = "median_abs_error"

    def build_data(self) -> TaskData:
        return TaskData(
            KeyedTensors(256, 0),
            KeyedTensors(64, 1),
            collate,
            1,
            ["data: synthetic regression"],
            label_space={"targets": ["y"]},
        )

    def build_model(self, num_outputs: int) -> nn.Module:
        return TargetAwareLinear()

    def train_batch(self, batch):
        d = self.dist.device
        return {"x": batch["x"].to(d), "y": batch["y"].to(d), "n": batch["x"].shape[0]}

    eval_batch = train_batch

    def model_step(self, model, batch) -> StepOutput:
        pred = model(batch["x"], targets=batch["y"])
        mse = torch.nn.functional.mse_loss(pred.float(), batch["y"])
        l1 = torch.nn.functional.l1_loss(pred.float(), batch["y"])
        return StepOutput(
            loss=mse + 0.1 * l1, outputs=pred, n=batch["n"], terms={"mse": mse.detach(), "l1": l1.detach()}
        )

    def predict(self, model, batch):
        return model(batch["x"])

    @classmethod
    def evaluator_class(cls):
        return MedianErrorEvaluator

    def evaluator(self):
        return MedianErrorEvaluator()

    def example_batch(self, batch_size, *, image_size=None, num_outputs=1000, train=True):
        d = self.dist.device
        return {"x": torch.randn(batch_size, DIM, device=d), "y": torch.randn(batch_size, device=d), "n": batch_size}
