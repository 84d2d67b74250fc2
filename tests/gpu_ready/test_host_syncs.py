"""No host sync in steady state (issue 24): one training step with each feature on makes the host wait for the
device no more often than stock Megatron's same step does.

Each case trains the tiny GPT with ``adacc train`` and counts, in its third step, every point where a GPU's host
would wait for the device (:mod:`megatron_adacc.testing.syncs`: reads of device values, shapes that depend on
data, host-device copies), then compares them, op and call site, with the same step of stock Megatron. The third
step is the steady state: the first holds the allocations, GACT's sensitivity probe and the outlier codec's one
exact pass per place; Adacc's evolution samples on iterations 1, 2, 4, 8, ... (its tracking iterations, which
read what they measure on purpose). Any sync a feature adds fails the test and is listed with its call stack.

On a GPU the same steps run once more on CUDA, where torch itself reports every synchronizing call
(``torch.cuda.set_sync_debug_mode``), compiled code's included: scripts/gpu_acceptance.sh runs those cases
(ADACC_TEST_DEVICE=cuda, which makes a missing GPU a failure rather than a skip).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from megatron_adacc.adacc.policy.ops import OPS
from megatron_adacc.adacc.policy.policy import Decision, Policy
from megatron_adacc.testing.syncs import CudaSyncs, HostSyncs, Sync, describe, train_step_syncs

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--device", "cpu"]
ON_GPU = [*SMALL[:-1], "cuda"]
COUNTED_STEP = 3
RESIREDUCE_SCHEMES = ("residual", "a", "w", "d", "2d", "w+2d")
#: Each feature's command line (a callable when it needs the test's folder); Adacc's policy file compresses
#: every op with its layer-specific codec, so every Adacc codec and the 1-bit masks run.
FEATURES = {
    "adacc-layer-codecs": lambda tmp, base: ["--adacc-policy", str(_layer_codec_policy(tmp))],
    "adacc-quantize-all": ["--adacc-policy", "quantize-all"],
    "adacc-auto": lambda tmp, base: _auto_with_compression(base),
    "gact-L1": ["--gact-level", "L1"],
    "adama": ["--adama", "--clip-grad", "0"],
    "adama-distributed": ["--adama", "--use-distributed-optimizer", "--clip-grad", "0", "--ddp-bucket-size", "5000"],
    **{f"resireduce-{s}-topk": ["--resireduce", s, "--grad-compressor", "topk"] for s in RESIREDUCE_SCHEMES},
    **{f"resireduce-w+2d-{c}": ["--resireduce", "w+2d", "--grad-compressor", c] for c in ("dgc", "qsgd")},
}


@dataclass(frozen=True)
class Allowed:
    """A sync the features may add: the op, the files of its two innermost frames, and why it stops no GPU."""

    op: str
    frames: tuple[str, str]
    reason: str

    def covers(self, sync: Sync) -> bool:
        return sync.op == self.op and all(f in frame for f, frame in zip(self.frames, sync.stack))


ALLOWED = (
    Allowed("aten._local_scalar_dense.default", ("megatron_adacc/codecs/_backend.py", "megatron_adacc/codecs/int4.py"),
            "inside the compiled CPU kernels of the outlier codec: csrc/codecs_cpu.cpp checks the channel indices "
            "with idx.min().item() / idx.max().item(), reads of host memory; the CUDA kernels read nothing back "
            "(they bound the indices in the kernel). The counter cannot see into compiled code, CPU or CUDA"),
)
#: Per-step logging: none. Every figure a feature reports per step is a Python number it already has (traffic
#: bytes, packed sizes) or stays on the device until a report reads it (GACT's gradient variance).


@pytest.fixture(autouse=True)
def _uninstall(monkeypatch, tmp_path):
    from megatron_adacc.codecs import int4

    monkeypatch.setenv("ADACC_PROFILE_DB", str(tmp_path / "profile.sqlite"))
    # Q, K and V's smoothed codec branches on a value of the data only on a CPU device, where that costs
    # nothing; the counter takes the model's tensors for device tensors, so it checks the codec's GPU path
    monkeypatch.setattr(int4, "_host_reads_are_free", lambda device: False)
    yield
    from megatron_adacc.adacc.integration import uninstall

    uninstall()


@pytest.fixture(scope="module")
def stock() -> HostSyncs:
    syncs, _ = train_step_syncs(SMALL, COUNTED_STEP)
    assert syncs.events, "stock Megatron's step reads its loss and gradient norm: the counter sees nothing"
    return syncs


def _layer_codec_policy(tmp):
    from megatron_adacc.adacc.policy.io import save_policy

    policy = Policy.uniform({op.name: Decision.compress(op.default_codec) for op in OPS}, 2)
    return save_policy(policy, tmp / "layer-codecs.json")


def _auto_with_compression(base: list[str]) -> list[str]:
    """``auto`` at the smallest budget it can meet, where it must compress. The budget counts the process's
    memory too, so the baseline is fixed (a measured one varies by more than the tiny model's activations)."""
    from megatron_adacc.adacc.integration.policy_source import resolve_policy
    from megatron_adacc.adacc.policy.strategies.base import InfeasibleBudgetError
    from megatron_adacc.testing import tiny_config
    from megatron_adacc.training.args import parse_train_args

    flags = ["--adacc-policy", "auto", "--adacc-process-baseline", "360MiB", "--adacc-memory-budget"]
    try:
        resolve_policy(parse_train_args(base + flags + ["1MiB"]), tiny_config(), isolate=True)
    except InfeasibleBudgetError as refused:
        return flags + [str(refused.min_feasible_bytes + 1024)]
    raise AssertionError("auto met a 1 MiB budget")


def _did_its_work(feature: str, run) -> None:
    """The feature ran where the counter looked: compressed activations, gradients, or folded them."""
    reports = {ext.name: ext.report() for ext in run.extensions}
    if feature.startswith("adacc"):
        assert any(label.startswith("compress:") for label in reports["adacc"]["decisions"]), reports["adacc"]
    elif feature.startswith("gact"):
        assert run.extensions[0].controller.compressor.last_stats.compressed_tensors > 0
    elif feature.startswith("resireduce"):  # one process: nothing is sent, but every gradient is compressed
        assert run.extensions[0].attachment.reducer.traffic.batches >= COUNTED_STEP
    else:
        assert getattr(run.optimizer, "folds_gradients", False)


def _flags(feature: str, tmp_path, base: list[str]) -> list[str]:
    argv = FEATURES[feature]
    return base + (argv(tmp_path, base) if callable(argv) else argv)


@pytest.mark.parametrize("feature", FEATURES)
def test_a_feature_adds_no_host_sync_to_stock_megatrons_step(stock, feature, tmp_path):
    syncs, run = train_step_syncs(_flags(feature, tmp_path, SMALL), COUNTED_STEP)
    _did_its_work(feature, run)
    added = [s for s in syncs.added_to(stock) if not any(a.covers(s) for a in ALLOWED)]
    assert not added, (f"{feature} makes the host wait for the device {len(added)} more time(s) per training step "
                       f"than stock Megatron (op, call site and callers; see megatron_adacc/testing/syncs.py):\n"
                       f"{describe(added)}")


@pytest.fixture(scope="module")
def stock_on_gpu() -> CudaSyncs:
    if not torch.cuda.is_available():
        if os.environ.get("ADACC_TEST_DEVICE") == "cuda":
            pytest.fail("ADACC_TEST_DEVICE=cuda but torch sees no CUDA device", pytrace=False)
        pytest.skip("needs a GPU (scripts/gpu_acceptance.sh runs these)")
    syncs, _ = train_step_syncs(ON_GPU, COUNTED_STEP, CudaSyncs)
    return syncs


@pytest.mark.parametrize("feature", FEATURES)
def test_on_a_gpu_a_feature_adds_no_synchronizing_cuda_call(stock_on_gpu, feature, tmp_path):
    syncs, run = train_step_syncs(_flags(feature, tmp_path, ON_GPU), COUNTED_STEP, CudaSyncs)
    _did_its_work(feature, run)
    added = syncs.added_to(stock_on_gpu)
    assert not added, (f"{feature} synchronizes the CUDA stream {len(added)} more time(s) per training step than "
                       f"stock Megatron, as torch.cuda.set_sync_debug_mode reports (call site and callers):\n"
                       f"{describe(added)}")
