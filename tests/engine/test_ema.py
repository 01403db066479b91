"""The EMA's update (trainer/engine/ema.py): the same values as torch's ``AveragedModel`` bit for bit, frozen
parameters left out, resume through ``state_dict``, and no host sync per step."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.profiler import profile

from trainer.engine.ema import build_ema


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def _train_steps(model: nn.Module, emas: list, steps: int, seed: int = 1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for e in emas:
            e.update_parameters(model)


def _same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def test_the_update_equals_torchs_averaged_model_bit_for_bit():
    model = _model()
    ours = build_ema(model, 0.9)
    torchs = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    _train_steps(model, [ours, torchs], 5)
    _same(ours, torchs)
    assert int(ours.n_averaged) == 5
    assert int(ours.module[1].num_batches_tracked) == int(torchs.module[1].num_batches_tracked)


def test_frozen_parameters_are_left_out_and_the_rest_averaged():
    model = _model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    ema = build_ema(model, 0.5)
    ema.update_parameters(model)  # the first update copies
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # frozen ones too: the EMA must not follow them
    ema.update_parameters(model)
    assert torch.allclose(ema.module[0].weight, model[0].weight - 1.0, atol=1e-6)  # not followed
    assert torch.allclose(ema.module[4].weight, model[4].weight - 0.5)


def test_resume_through_state_dict_continues_the_same_average():
    model = _model()
    straight = build_ema(model, 0.9)
    twin = copy.deepcopy(model)
    _train_steps(model, [straight], 6)
    first = build_ema(twin, 0.9)
    _train_steps(twin, [first], 3)
    resumed = build_ema(twin, 0.3)  # a fresh EMA whose count comes from the loaded buffer, not from __init__
    resumed.decay = 0.9
    resumed.load_state_dict(first.state_dict())
    reference = copy.deepcopy(first)
    g = torch.Generator().manual_seed(7)
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for _ in range(3):
        twin(torch.randn(4, 3, 8, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        resumed.update_parameters(twin)
        reference.update_parameters(twin)
    _same(resumed, reference)
    assert int(resumed.n_averaged) == 6


def test_no_host_sync_per_update():
    model = _model()
    ema = build_ema(model, 0.9)
    ema.update_parameters(model)
    ema.update_parameters(model)  # the count mirror is set
    with profile() as prof:
        for _ in range(3):
            ema.update_parameters(model)
    names = [e.name for e in prof.events()]
    assert names.count("aten::_local_scalar_dense") == 0
    assert names.count("aten::_foreach_lerp_") == 3  # one float32 group per update
