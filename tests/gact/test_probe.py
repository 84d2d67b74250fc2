"""GACT's sensitivity probe (Algorithm 1) on its own: wired straight to a compressor, no controller."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_adacc.gact.hooks import SavedTensorCompressor
from megatron_adacc.gact.probe import SensitivityProbe


class TwoBranches(nn.Module):
    """``sum((x1 @ w1) * r1) + sum((x2 @ w2) * r2)``: the only tensors compressed are x1 (id 0) and x2 (id 1),
    and ``grad w_i = x_i^T r_i`` is linear in the saved ``x_i`` (the buffers ``r_i`` are kept exactly)."""

    def __init__(self, noise: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(32, 16, generator=g))
        self.w2 = nn.Parameter(torch.randn(32, 16, generator=g))
        self.register_buffer("r1", torch.randn(64, 16, generator=g))
        self.register_buffer("r2", torch.randn(64, 16, generator=g))
        self.x1 = torch.randn(64, 32, generator=g)
        self.x2 = torch.randn(64, 32, generator=g) * 3
        self.noise = noise

    def forward_backward(self) -> torch.Tensor:
        x1 = self.x1 + torch.rand_like(self.x1) if self.noise else self.x1  # draws from the global RNG
        loss = ((x1 @ self.w1) * self.r1).sum() + ((self.x2 @ self.w2) * self.r2).sum()
        loss.backward()
        return loss.detach()


def wire(model: nn.Module, codec_factory, bits: int = 2, repeats: int = 1):
    probe = SensitivityProbe(bits, repeats)
    compressor = SavedTensorCompressor(lambda: [*model.parameters(), *model.buffers()], 64, probe.bits_for,
                                       probe.seed_for, codec_factory=codec_factory)
    return probe, compressor


def estimate(model, codec_factory, fn=None, **kw):
    probe, compressor = wire(model, codec_factory, **kw)
    est = probe.estimate(fn or model.forward_backward, compressor, list(model.parameters()), seed=3)
    return est, probe, compressor


def test_each_tensor_is_measured_on_its_own_path_and_scales_with_the_squared_gradient(codec_factory):
    model = TwoBranches()
    base, probe, _ = estimate(model, codec_factory)
    assert sorted(base) == [0, 1] and all(c > 0 for c in base.values())
    assert probe.dims == {0: 64 * 32, 1: 64 * 32}
    assert probe.noise_floor == 0.0  # a replayed batch gives bit-identical gradients
    with torch.no_grad():
        model.r2.mul_(10)  # grad w2 = x2^T r2: ten times the gradient noise from x2, none from x1
    scaled, _, _ = estimate(model, codec_factory)
    assert scaled[0] == pytest.approx(base[0], rel=1e-9)
    assert scaled[1] == pytest.approx(100 * base[1], rel=1e-3)
    with torch.no_grad():
        model.r1.zero_()  # x1's compression noise no longer reaches any gradient
    assert estimate(model, codec_factory)[0][0] == 0.0


def test_only_the_perturbed_tensor_changes_seed(codec_factory):
    model = TwoBranches()
    probe, compressor = wire(model, codec_factory)
    seeds: list[tuple[int, int]] = []
    compressor.seed_for = lambda tid: seeds.append((tid, probe.seed_for(tid))) or seeds[-1][1]
    probe.estimate(model.forward_backward, compressor, list(model.parameters()))
    passes = [dict(seeds[i:i + 2]) for i in range(0, len(seeds), 2)]
    assert len(passes) == 4  # g0, its control, then one pass per perturbed tensor (L + 2)
    g0, control, perturb0, perturb1 = passes
    assert control == g0
    assert perturb0[1] == g0[1] and perturb0[0] != g0[0]
    assert perturb1[0] == g0[0] and perturb1[1] != g0[1]


def test_probe_leaves_no_trace(codec_factory):
    """Gradients discarded, every RNG restored, probe passes kept out of the memory figures; dropout-like
    randomness repeats in every evaluation (else the control pass would differ)."""
    model = TwoBranches(noise=True)
    calls = []

    def counted():
        calls.append(1)
        return model.forward_backward()

    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    est, probe, compressor = estimate(model, codec_factory, fn=counted, repeats=2)
    assert torch.equal(torch.rand(3), expected)
    assert len(calls) == 2 * (len(est) + 2)
    assert probe.noise_floor == 0.0 and not probe.active and probe.seconds > 0
    assert all(p.grad is None for p in model.parameters())
    assert compressor.recording and compressor.passes == len(calls) and compressor.peak_raw_bytes == 0


def test_a_forward_that_saves_a_different_number_of_tensors_is_refused(codec_factory):
    model = TwoBranches()
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 3:  # the first perturbed pass takes another branch
            with torch.no_grad():
                extra = model.x1 * 2
            (extra @ model.w1).sum().backward()
        return model.forward_backward()

    probe, compressor = wire(model, codec_factory)
    with pytest.raises(RuntimeError, match="different number of tensors"):
        probe.estimate(flaky, compressor, list(model.parameters()))
    assert not probe.active and compressor.recording
    assert all(p.grad is None for p in model.parameters())


def test_a_forward_that_draws_a_fresh_batch_is_refused(codec_factory):
    model = TwoBranches()
    loader = torch.Generator().manual_seed(5)  # a data loader's own stream: the probe's RNG reset misses it

    def fresh_batch():
        model.x1 = torch.randn(64, 32, generator=loader)
        return model.forward_backward()

    probe, compressor = wire(model, codec_factory, bits=4)
    with pytest.raises(RuntimeError, match="replay the same batch"):
        probe.estimate(fresh_batch, compressor, list(model.parameters()))
    assert probe.noise_floor > 0


def test_bad_arguments_and_misuse_are_named():
    with pytest.raises(ValueError, match="probe_repeats"):
        SensitivityProbe(4, repeats=0)
    with pytest.raises(ValueError, match="below 32"):
        SensitivityProbe(32)
    with pytest.raises(RuntimeError, match="outside estimate"):
        SensitivityProbe(4).seed_for(0)
