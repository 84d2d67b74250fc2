"""m, v, master weights and step counts survive a save/load round trip bit-exactly."""

from __future__ import annotations

import io

import pytest
import torch

from megatron_adacc.optim import AdamA

torch.set_num_threads(1)


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.Tanh(), torch.nn.Linear(10, 2)).to(dtype)


def run(model, opt, steps: int, seed: int, n: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(n):
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)
            torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y).backward()
        opt.step()


def new_opt(model) -> AdamA:
    return AdamA(model.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True,
                 num_microbatches=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_is_bit_exact(dtype):
    model = make_model(dtype)
    opt = new_opt(model)
    run(model, opt, steps=3, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    run(model, opt, steps=3, seed=2)  # the uninterrupted run

    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = make_model(dtype)
    resumed.load_state_dict(ckpt["model"])
    opt2 = AdamA(resumed.parameters(), lr=1.0, num_microbatches=1)  # hyper-parameters come from the ckpt
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.num_microbatches == 3
    for p in resumed.parameters():
        st = opt2.state[p]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        assert float(st["step"]) == 3
        if dtype != torch.float32:
            assert st["master_param"].dtype == torch.float32
    run(resumed, opt2, steps=3, seed=2)

    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
        if dtype != torch.float32:
            assert torch.equal(opt.state[p]["master_param"], opt2.state[q]["master_param"])
