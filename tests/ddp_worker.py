"""Run under torchrun by tests/test_ddp.py: train, then save this rank's parameters for comparison."""

import sys
from pathlib import Path

import torch

from trainer.cli import parse_train_config
from trainer.engine import distributed as dist
from trainer.engine.trainer import Trainer

if __name__ == "__main__":
    out = Path(sys.argv[1])
    cfg = parse_train_config(sys.argv[2:])
    info = dist.init(cfg.device)
    trainer = Trainer(cfg, info)
    trainer.fit()
    trainer.close()
    torch.save({k: v.detach().clone() for k, v in trainer.model.named_parameters()}, out / f"rank{info.rank}.pt")
    dist.shutdown()
