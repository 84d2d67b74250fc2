"""Gradient and RNG tools of GACT's sensitivity probe (Algorithm 1, :mod:`~megatron_adacc.gact.probe`).

Memory discipline: the original implementation concatenated every parameter gradient into one vector for
each of three probe evaluations and for the running mean, so a probe held several extra model-sized
buffers at once (and leaked them). Here gradients are read parameter by parameter: a probe holds exactly
one reference gradient copy (``g0``) and reduces every later evaluation against it in place (the variance
monitor, :mod:`~megatron_adacc.gact.monitor`, holds one running-mean buffer). Nothing is ever concatenated.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch


def gradient_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient a step uses: Megatron DDP accumulates into ``main_grad``, plain torch into ``.grad``."""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def zero_gradients(params: Iterable[torch.Tensor]) -> None:
    for p in params:
        g = getattr(p, "main_grad", None)
        if g is not None:
            g.zero_()
        p.grad = None


def snapshot_gradients(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    out = []
    for p in params:
        g = gradient_of(p)
        out.append(None if g is None else g.detach().clone())
    return out


def squared_distance_inplace(params: Sequence[torch.Tensor], ref: Sequence[torch.Tensor | None]) -> float:
    """``||g - ref||^2`` over all parameters, computed per parameter; overwrites the live gradients."""
    total = 0.0
    for p, r in zip(params, ref):
        g = gradient_of(p)
        if g is None and r is None:
            continue
        if g is None:
            total += float(torch.linalg.vector_norm(r.double()) ** 2)
            continue
        d = g.detach()
        if r is not None:
            d.sub_(r)
        total += float(torch.linalg.vector_norm(d, dtype=torch.float64) ** 2)
    return total


@contextlib.contextmanager
def frozen_rng() -> Iterator[Callable[[], None]]:
    """Yield ``reset()``, which puts every RNG back where it was on entry (so dropout masks repeat across
    probe evaluations); on exit the RNGs are restored, so probes do not shift the training RNG stream.
    Megatron's model-parallel RNG tracker (attention dropout) is included when megatron-core is loaded."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    tracker = None
    # Looked up, not imported: a model that uses the tracker has loaded it, and a plain torch model must not
    # pull megatron-core in.
    mpu_random = sys.modules.get("megatron.core.tensor_parallel.random")
    try:
        if mpu_random is not None:
            tracker = mpu_random.get_cuda_rng_tracker()
            tracker_states = tracker.get_states()
    except (AttributeError, RuntimeError):  # no tracker: torch RNG only
        tracker = None

    def reset() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if tracker is not None:
            tracker.set_states(dict(tracker_states))  # fork() writes into the dict it is given

    try:
        yield reset
    finally:
        reset()
