"""Gradients are really released during backward (measured with weak references, not assumed)."""

from __future__ import annotations

import gc

import torch

from megatron_adacc.optim import AdamA
from megatron_adacc.optim.meter import LiveGradientMeter

torch.set_num_threads(1)

LAYERS, WIDTH = 6, 64


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_microbatches(model: torch.nn.Module, n: int, divide: bool) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(n):
        loss = model(torch.randn(8, WIDTH, generator=g)).square().mean()
        (loss / n if divide else loss).backward()


def test_adama_holds_at_most_one_tensor_gradient_during_backward():
    model = make_model()
    meter = LiveGradientMeter(model.parameters())  # registered first: sees each grad before AdamA frees it
    opt = AdamA(model.parameters(), lr=1e-3, num_microbatches=4)
    run_microbatches(model, 4, divide=False)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # While a gradient is being folded only it is alive: every earlier one has been freed.
    assert meter.peak_bytes == largest
    gc.collect()
    assert meter.live_bytes() == 0
    assert all(p.grad is None for p in model.parameters())
    opt.step()


def test_gradient_accumulation_baseline_holds_the_whole_gradient():
    """The same meter on Adam with gradient accumulation sees the full gradient buffer (the meter works)."""
    model = make_model()
    meter = LiveGradientMeter(model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    run_microbatches(model, 4, divide=True)
    assert meter.peak_bytes == param_bytes(model)
    assert meter.live_bytes() == param_bytes(model)
    opt.step()


def test_a_gradient_kept_alive_elsewhere_is_counted():
    """Unlinking .grad is not enough: a lingering reference keeps the bytes live, and the meter sees it."""
    model = make_model()
    meter = LiveGradientMeter(model.parameters())
    leaked = []
    first = next(model.parameters())
    first.register_post_accumulate_grad_hook(lambda p: leaked.append(p.grad))  # runs before AdamA's
    AdamA(model.parameters(), lr=1e-3)
    run_microbatches(model, 1, divide=False)
    assert meter.live_bytes() == first.numel() * first.element_size()
    leaked.clear()
    assert meter.live_bytes() == 0
