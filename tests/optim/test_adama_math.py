"""AdamA's update rule against torch's Adam/AdamW, a hand-written oracle and hand-computed numbers."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from megatron_adacc.optim import AdamA

torch.set_num_threads(1)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Tanh(),
        torch.nn.Linear(12, 3),
    ).to(dtype)


Batches = list[list[tuple[torch.Tensor, torch.Tensor]]]


def make_data(steps: int, n: int, batch: int = 4, seed: int = 1) -> Batches:
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)) for _ in range(n)]
            for _ in range(steps)]


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def train_adama(model, opt, data, divide_loss_by: float = 1.0, loss_scale: float = 1.0):
    for minibatch in data:
        opt.zero_grad()
        for x, y in minibatch:
            (loss_fn(model, x, y) * loss_scale / divide_loss_by).backward()
        opt.step()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    ("torch_cls", "kwargs", "decoupled"),
    [
        (torch.optim.Adam, {}, False),
        (torch.optim.Adam, {"weight_decay": 0.1}, False),  # coupled L2 decay
        (torch.optim.AdamW, {"weight_decay": 0.1}, True),
        (torch.optim.Adam, {"betas": (0.5, 0.9), "eps": 1e-3}, False),
    ],
)
def test_one_microbatch_equals_torch_adam(torch_cls, kwargs, decoupled):
    ref, ours = make_model(), make_model()
    ref_opt = torch_cls(ref.parameters(), lr=1e-2, **kwargs)
    opt = AdamA(ours.parameters(), lr=1e-2, decoupled_weight_decay=decoupled, **kwargs)
    for minibatch in make_data(steps=8, n=1):
        x, y = minibatch[0]
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
    train_adama(ours, opt, make_data(steps=8, n=1))
    assert max_diff(ref, ours) < 1e-6
    for p, q in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(opt.state[q]["exp_avg"], ref_opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(opt.state[q]["exp_avg_sq"], ref_opt.state[p]["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-10)
        assert float(opt.state[q]["step"]) == 8


def test_m_equals_accumulated_adam_m_and_v_is_sum_of_squares():
    """One mini-batch of N=4 from one start: m is Adam-with-accumulation's; v = (1-b2) sum (g_i/N)^2."""
    n, beta2 = 4, 0.95
    ref, ours = make_model(), make_model()
    data = make_data(steps=1, n=n)[0]
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, betas=(0.8, beta2))
    ref_opt.zero_grad()
    micro_grads = []
    for x, y in data:
        micro_grads.append(torch.autograd.grad(loss_fn(ref, x, y), list(ref.parameters())))
        (loss_fn(ref, x, y) / n).backward()
    ref_opt.step()
    opt = AdamA(ours.parameters(), lr=1e-2, betas=(0.8, beta2), num_microbatches=n)
    train_adama(ours, opt, [data])
    for j, (p, q) in enumerate(zip(ref.parameters(), ours.parameters())):
        torch.testing.assert_close(opt.state[q]["exp_avg"], ref_opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-9)
        expected_v = (1 - beta2) * sum((g[j] / n) ** 2 for g in micro_grads)
        torch.testing.assert_close(opt.state[q]["exp_avg_sq"], expected_v, rtol=1e-5, atol=1e-12)
        # ... and that v is NOT Adam's square of the sum (the intended difference), on this data.
        assert not torch.allclose(opt.state[q]["exp_avg_sq"], ref_opt.state[p]["exp_avg_sq"], rtol=1e-3)


def reference_adama(model, data, lr, betas, eps, wd, decoupled):
    """Algorithm 1/2 written out with explicit per-micro-batch gradients (no hooks)."""
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    b1, b2 = betas
    for t, minibatch in enumerate(data, start=1):
        n = len(minibatch)
        grads = [torch.autograd.grad(loss_fn(model, x, y), params) for x, y in minibatch]
        with torch.no_grad():
            for j, p in enumerate(params):
                gs = [(gr[j] + (0 if decoupled else wd * p)) / n for gr in grads]
                m[j] = b1 * m[j] + (1 - b1) * sum(gs)
                v[j] = b2 * v[j] + (1 - b2) * sum(g * g for g in gs)
                if decoupled:
                    p.mul_(1 - lr * wd)
                m_hat = m[j] / (1 - b1**t)
                v_hat = v[j] / (1 - b2**t)
                p.sub_(lr * m_hat / (v_hat.sqrt() + eps))
    return m, v


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("n", [2, 3])
def test_multi_step_matches_oracle(n, decoupled):
    ref, ours = make_model(), make_model()
    data = make_data(steps=5, n=n)
    m, v = reference_adama(ref, data, lr=5e-3, betas=(0.9, 0.99), eps=1e-8, wd=0.05, decoupled=decoupled)
    opt = AdamA(ours.parameters(), lr=5e-3, betas=(0.9, 0.99), weight_decay=0.05,
                decoupled_weight_decay=decoupled, num_microbatches=n)
    train_adama(ours, opt, data)
    assert max_diff(ref, ours) < 1e-5
    for j, q in enumerate(ours.parameters()):
        torch.testing.assert_close(opt.state[q]["exp_avg"], m[j], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(opt.state[q]["exp_avg_sq"], v[j], rtol=1e-4, atol=1e-10)


def test_hand_computed_scalar():
    """theta=1, loss_i = c_i * theta with c = (1, 3), N=2, beta=(0.5, 0.5), lr=0.1, eps=0.

    g_i = c_i / 2 = (0.5, 1.5); m = 0.5 * 2 = 1.0; v = 0.5 * (0.25 + 2.25) = 1.25.
    m_hat = 1 / 0.5 = 2; v_hat = 1.25 / 0.5 = 2.5; theta = 1 - 0.1 * 2 / sqrt(2.5).
    """
    theta = torch.nn.Parameter(torch.tensor([1.0]))
    opt = AdamA([theta], lr=0.1, betas=(0.5, 0.5), eps=0.0, num_microbatches=2)
    for c in (1.0, 3.0):
        (c * theta).sum().backward()
    opt.step()
    assert opt.state[theta]["exp_avg"].item() == pytest.approx(1.0)
    assert opt.state[theta]["exp_avg_sq"].item() == pytest.approx(1.25)
    assert theta.item() == pytest.approx(1.0 - 0.1 * 2.0 / math.sqrt(2.5), rel=1e-6)


def test_loss_already_divided_and_static_loss_scale_give_same_result():
    data = make_data(steps=3, n=4)
    base = make_model()
    train_adama(base, AdamA(base.parameters(), lr=1e-2, num_microbatches=4), data)
    divided = make_model()
    train_adama(divided, AdamA(divided.parameters(), lr=1e-2, num_microbatches=4,
                               scale_by_num_microbatches=False), data, divide_loss_by=4)
    scaled = make_model()
    train_adama(scaled, AdamA(scaled.parameters(), lr=1e-2, num_microbatches=4, loss_scale=1024.0),
                data, loss_scale=1024.0)
    assert max_diff(base, divided) < 1e-6
    assert max_diff(base, scaled) < 1e-6


def test_per_tensor_clipping_hand_computed():
    """Gradients (3, 4) (norm 5) and (0.3, 0.4) clipped to norm 1: folded as (0.6, 0.8) and (0.3, 0.4)."""
    w = torch.nn.Parameter(torch.zeros(2))
    opt = AdamA([w], lr=0.1, betas=(0.0, 0.0), num_microbatches=2, clip_grad_per_tensor=1.0)
    for c in (torch.tensor([3.0, 4.0]), torch.tensor([0.3, 0.4])):
        (c * w).sum().backward()
    # beta1 = 0: m = sum g_i / N = ((0.6, 0.8) + (0.3, 0.4)) / 2.
    torch.testing.assert_close(opt.state[w]["exp_avg"], torch.tensor([0.45, 0.6]), rtol=1e-5, atol=1e-6)
    expected_v = (torch.tensor([0.6, 0.8]) ** 2 + torch.tensor([0.3, 0.4]) ** 2) / 4
    torch.testing.assert_close(opt.state[w]["exp_avg_sq"], expected_v, rtol=1e-5, atol=1e-6)
    opt.step()


def test_bf16_params_keep_fp32_master_and_states():
    """A bf16 model: states and master are fp32, and the master follows fp32 AdamA fed the same grads."""
    model16 = make_model(dtype=torch.bfloat16)
    model32 = copy.deepcopy(model16).float()
    kw = {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True, "num_microbatches": 2}
    opt16 = AdamA(model16.parameters(), **kw)
    opt32 = AdamA(model32.parameters(), **kw)
    opt32.remove_hooks()
    for minibatch in make_data(steps=4, n=2):
        for x, y in minibatch:
            with opt16.accumulation_paused():
                loss_fn(model16, x, y).backward()
            for p16, p32 in zip(model16.parameters(), model32.parameters()):
                p32.grad = p16.grad.float()
            opt32.fold_grads()
            opt16.fold_grads()
        opt16.step()
        opt32.step()
    for p16, p32 in zip(model16.parameters(), model32.parameters()):
        st = opt16.state[p16]
        assert p16.dtype == torch.bfloat16
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == st["master_param"].dtype == torch.float32
        torch.testing.assert_close(st["master_param"], p32.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p16.detach(), st["master_param"].to(torch.bfloat16))
        # The master holds information the bf16 parameter cannot (updates smaller than a bf16 ulp).
    assert any(not torch.equal(opt16.state[p]["master_param"], p.float()) for p in model16.parameters())


def test_parameters_without_gradient_are_skipped_like_adam():
    model = make_model()
    frozen_out = model[4]
    opt = AdamA(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in frozen_out.parameters()]
    x, _y = make_data(steps=1, n=1)[0][0]
    # Only the first layers get gradients: backward from an intermediate activation.
    model[:4](x).sum().backward()
    opt.step()
    for p, b in zip(frozen_out.parameters(), before):
        assert torch.equal(p.detach(), b)
        assert p not in opt.state or "exp_avg" not in opt.state[p]


def test_gradients_never_remain_in_grad_and_pause_keeps_them():
    model = make_model()
    opt = AdamA(model.parameters(), lr=1e-2, num_microbatches=1)
    x, y = make_data(steps=1, n=1)[0][0]
    loss_fn(model, x, y).backward()
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    opt.zero_grad()
    with opt.accumulation_paused():
        loss_fn(model, x, y).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert opt.pending_folds == 0


def test_errors_name_the_problem():
    model = make_model()
    opt = AdamA(model.parameters(), lr=1e-2, num_microbatches=2)
    x, y = make_data(steps=1, n=1)[0][0]
    loss_fn(model, x, y).backward()
    with pytest.raises(RuntimeError, match="cannot be discarded"):
        opt.zero_grad()
    with pytest.raises(RuntimeError, match="middle of a mini-batch"):
        opt.state_dict()
    with pytest.raises(RuntimeError, match="received 1 micro-batch gradients"):
        opt.step()  # N=2 declared, 1 folded
    opt2 = AdamA(make_model().parameters(), lr=1e-2)
    for p in opt2.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="never folded"):
        opt2.step()
    with pytest.raises(ValueError, match="num_microbatches"):
        AdamA(make_model().parameters(), num_microbatches=0)


def test_non_finite_gradient_raises_instead_of_silently_stepping():
    w = torch.nn.Parameter(torch.ones(3))
    opt = AdamA([w], lr=0.1)
    (w * torch.tensor([1.0, float("inf"), 1.0])).sum().backward()
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(3))


def test_a_host_that_asks_for_the_finite_flag_takes_over_the_check_from_step():
    """The training loop reads AdamA's flag with its own per-step read; step() then reads nothing itself."""
    from megatron_adacc.testing.syncs import HostSyncs

    w = torch.nn.Parameter(torch.ones(3))
    opt = AdamA([w], lr=0.1, strict_microbatch_count=False)
    assert opt.states_finite() is None  # nothing folded yet
    with HostSyncs(recording=False) as syncs:  # on from the start: it learns that the step counts are host tensors
        (w * 2).sum().backward()
        flag = opt.states_finite()
        syncs.recording = True
        opt.step()
    assert syncs.events == [] and bool(flag) and not torch.equal(w.detach(), torch.ones(3))
    (w * torch.tensor([1.0, float("inf"), 1.0])).sum().backward()
    assert not bool(opt.states_finite())
    (w * 2).sum().backward()  # a fold after the verdict is not covered by it: step() checks again
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step()
