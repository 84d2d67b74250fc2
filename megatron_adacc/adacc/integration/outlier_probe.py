"""Outlier statistics of the model being trained, sampled for adaptive policy evolution (paper section 3.4, Fig. 4).

How much outlier-separated INT4 (``int4_outlier``) saves on an op's output depends on how many of its channels
are outliers (Z-score of channel absolute sums above the threshold, eq. 1), and that count drifts during
training. Evolution must see it for EVERY op that offers the codec, whatever the policy does with the op now:
an op recomputed (or kept) because its outliers were many when it was profiled is exactly the one a falling
count should turn to compression. The runtime's own accounting only sees what it compressed, so this module
samples the statistics itself.

How, cheaply and without touching training:

* :meth:`OutlierProbe.arm` (evolution calls it before a tracking iteration) puts forward pre-hooks on each model
  chunk's ``TransformerBlock`` (for the attention mask and rotary embeddings) and on its first layer's input
  layernorm (for the hidden states: that module is called both by megatron's own layer forward, which keep-all
  layers run, and by the runtime's first op). They hold references, without a copy, to each training
  micro-batch's inputs in turn: the last micro-batch's, whose backward has run when the step ends, are what is
  left (a micro-batch's layer input lives until its backward anyway). :meth:`OutlierProbe.measure` removes
  them: every normal iteration pays nothing.
* After the step, :meth:`OutlierProbe.measure` runs each chunk's layers on those inputs op by op with the
  runtime's decomposition (:mod:`megatron_adacc.adacc.runtime.ops`), under ``torch.no_grad``, without dropout
  (:func:`_without_dropout`) and with every random generator forked (training's dropout streams are left
  exactly where they were), dropping each value once no later op reads it (it holds no more than a no-grad
  forward would). Per op offering ``int4_outlier``
  it counts the outlier channels of the op's output as the codec selects them, and on the last layer it
  re-times the codec on the real tensors with the profiler's own
  :func:`~megatron_adacc.adacc.integration.profiler.time_codecs` (raw times, as profiles store them). Every
  reference is dropped before it returns.
* A layer whose policy re-runs its MLP in token tiles (:mod:`megatron_adacc.adacc.runtime.tiled`) is probed in
  the same tiles, its channel sums added up over them (a sum over rows is one over slices of rows). The
  probe's matrix products then have the shapes training's have, and no others: MKL keeps a buffer for every
  shape of product it has run until the process ends, so one untiled ``linear_fc1`` and ``linear_fc2`` of
  llama-tiny left 19 MiB more allocated (2-3 MiB of it resident) at every later step's peak, which no memory
  model predicts (measured 2026-11-28: a 418.8 MiB budget, evolution on, peaked at 423 MiB against 419 off).
  A tiled op's outputs exist only a slice at a time, so its codec times are not re-measured; its profiled ones
  stay.

The result, per op, is an :class:`OpSample` averaged over the layers of this rank; evolution turns it into the
profile's units (:mod:`megatron_adacc.adacc.integration.evolution`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_adacc.adacc.integration.profiler import float_outputs, time_codecs
from megatron_adacc.adacc.policy.ops import OPS, OUTLIER_CODEC, TILED_OPS

#: The ops whose codec choices depend on outlier statistics: those that offer outlier-separated INT4.
OUTLIER_OPS: tuple[str, ...] = tuple(spec.name for spec in OPS if OUTLIER_CODEC in spec.codecs)

#: Runs of each codec timing (after one warm-up), as in a default profile.
TIMING_REPEATS = 3


@dataclass(frozen=True)
class OpSample:
    """One op's outlier statistics on a tracking iteration, averaged over the layers sampled."""

    outlier_channels: float
    """Outlier channels of the op's floating-point outputs (summed over them), mean over layers."""
    channels: int
    """Channels of those outputs (summed): what ``outlier_channels`` is out of."""
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of those outputs, for the codec's size formula."""
    dtype: torch.dtype
    compress_time_s: float | None = None
    """Raw compress time of the outputs on one sampled layer (not scaled by the profile's calibration, as the
    profiler stores it); None when not measured."""
    decompress_time_s: float | None = None
    layers: int = 1
    """How many layers the mean is over."""

    def codec_bytes_at(self, outlier_channels: float) -> float:
        """``int4_outlier``'s size of outputs of these shapes with ``outlier_channels`` outliers in all (split
        over the outputs by their channels). The codec's size is affine in the count, so a fractional mean
        count gives the mean size."""
        from megatron_adacc.codecs import get_codec

        codec = get_codec(OUTLIER_CODEC)
        total = 0.0
        for shape in self.shapes:
            k = outlier_channels * shape[-1] / self.channels if self.channels else 0.0
            none = codec.compressed_nbytes(shape, self.dtype, num_outliers=0)
            total += none + k * (codec.compressed_nbytes(shape, self.dtype, num_outliers=1) - none)
        return total

    @property
    def codec_bytes(self) -> float:
        """The codec's size of the outputs now."""
        return self.codec_bytes_at(self.outlier_channels)


# --------------------------------------------------------------------------------------------- statistics
def channel_sums(x: torch.Tensor) -> torch.Tensor:
    """``int4_outlier``'s channel absolute sums of ``x`` (same kernels), what its outlier selection reads."""
    from megatron_adacc.codecs._backend import kernels
    from megatron_adacc.codecs.base import rows_cols

    rows, cols = rows_cols(x.shape)
    return kernels("auto").channel_abs_sum(x.detach().reshape(rows, cols))


def outliers_of_sums(sums: torch.Tensor, z_threshold: float) -> int | None:
    """The outlier channels ``int4_outlier`` selects from channel absolute sums, or None when a sum is NaN/Inf
    (such a tensor says nothing about the codec)."""
    from megatron_adacc.codecs.reference import select_outlier_channels

    if not bool(torch.isfinite(sums).all()):
        return None
    return int(select_outlier_channels(sums, z_threshold).numel())


@dataclass(frozen=True)
class _LayerStat:
    outlier_channels: int
    channels: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype


@dataclass
class _Outputs:
    """One op's floating-point outputs as their channel sums, added up over the token slices of a tiled run
    (the slices cut the first dimension, so the full shapes add the slices' first sizes)."""

    sums: list[torch.Tensor]
    shapes: list[list[int]]
    dtype: torch.dtype

    @classmethod
    def of(cls, outs: Sequence[torch.Tensor]) -> _Outputs:
        return cls([channel_sums(x) for x in outs], [list(x.shape) for x in outs], outs[0].dtype)

    def add(self, more: _Outputs) -> _Outputs:
        for sums, shape, extra, extra_shape in zip(self.sums, self.shapes, more.sums, more.shapes):
            sums.add_(extra)
            shape[0] += extra_shape[0]
        return self

    def stat(self, z_threshold: float) -> _LayerStat | None:
        counts = [outliers_of_sums(sums, z_threshold) for sums in self.sums]
        if None in counts:
            return None
        return _LayerStat(sum(counts), sum(shape[-1] for shape in self.shapes),
                          tuple(tuple(shape) for shape in self.shapes), self.dtype)


class _Unsized:
    """What :func:`time_codecs` reads compressed bytes from; the probe scales the profile's bytes itself."""

    @staticmethod
    def compress_cost(key: Any) -> int:
        return 0


@dataclass
class LayerInputs:
    """The inputs of a run of consecutive layers (a model chunk's), as one training micro-batch gave them."""

    layers: Sequence[torch.nn.Module]
    hidden_states: torch.Tensor
    attention_mask: torch.Tensor | None
    rotary_pos_emb: Any
    tiles: Sequence[int] = ()
    """The token tiles each layer's policy re-runs its MLP in (1: untiled; empty: all untiled)."""


#: ``visit``'s last argument: None for an op run whole, ``(k, count)`` for slice ``k`` of a tiled run.
Part = tuple[int, int] | None


def run_layer(ops: Sequence[Any], env: dict, visit: Callable[[Any, dict, Part], None], tiles: int = 1) -> torch.Tensor:
    """Run one layer's ``ops`` on ``env`` (as :func:`~megatron_adacc.adacc.runtime.ops.run_ops`), calling
    ``visit(op, env, part)`` after each, and drop every value no later op reads: the probe holds no more than a
    no-grad forward does. With ``tiles`` > 1 the MLP's token-wise ops run slice by slice, as
    :class:`~megatron_adacc.adacc.runtime.tiled.TiledMLP`'s forward runs them. Returns the layer's output."""
    last_read = {name: i for i, op in enumerate(ops) for name in op.inputs}
    tiled = [i for i, op in enumerate(ops) if op.name in TILED_OPS] if tiles > 1 else []  # consecutive ops
    i = 0
    while i < len(ops):
        if tiled and i == tiled[0]:
            env.update(_run_tiled(ops[i:tiled[-1] + 1], env, tiles, visit))
            i = tiled[-1]
        else:
            env.update(ops[i].run(env))
            visit(ops[i], env, None)
        for name in [n for n in env if n != "output" and last_read.get(n, -1) <= i]:
            del env[name]
        i += 1
    return env["output"]


def _run_tiled(ops: Sequence[Any], env: Mapping[str, Any], tiles: int,
               visit: Callable[[Any, dict, Part], None]) -> dict[str, Any]:
    """The MLP's token-wise ``ops`` on ``tiles`` slices of the first one's inputs in turn; the last op's outputs,
    its tensors assembled from the slices (what the tiled block's forward returns)."""
    from megatron_adacc.adacc.runtime.tiled import tile_slices

    first = ops[0].inputs
    length = env[first[0]].size(0)
    slices = tile_slices(length, tiles)
    out: dict[str, Any] = {}
    for k, rows in enumerate(slices):
        part = {name: env[name][rows] for name in first}
        for op in ops:
            part.update(op.run(part))
            visit(op, part, (k, len(slices)))
        for name in ops[-1].outputs:
            value = part[name]
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                if name not in out:
                    out[name] = value.new_empty((length, *value.shape[1:]))
                out[name][rows] = value
            else:
                out[name] = value
    return out


@dataclass
class _Sampler:
    """Collects each outlier op's statistics layer by layer, and its codec times on one layer."""

    z_threshold: float
    repeats: int
    log: Callable[[str], None]
    stats: dict[str, list[_LayerStat]] = field(default_factory=dict)
    times: dict[str, tuple[float, float]] = field(default_factory=dict)
    partial: dict[str, _Outputs] = field(default_factory=dict)
    """A tiled run's sums so far, per op."""

    def visit(self, op: Any, env: dict, part: Part, *, timed: bool) -> None:
        if op.name not in OUTLIER_OPS:
            return
        outs = float_outputs(op, env)
        if not outs:
            return
        seen = _Outputs.of(outs)
        if part is not None:  # a slice of a tiled run: the stat is the whole run's, after its last slice
            k, count = part
            seen = self.partial.pop(op.name).add(seen) if k else seen
            if k < count - 1:
                self.partial[op.name] = seen
                return
        stat = seen.stat(self.z_threshold)
        if stat is not None:
            self.stats.setdefault(op.name, []).append(stat)
        if timed and part is None:
            self._time(op, env)

    def _time(self, op: Any, env: dict) -> None:
        """Raw compress / decompress time of ``int4_outlier`` on the op's outputs, by the profiler's own code."""
        from megatron_adacc.adacc.runtime.memory import codec_key

        outs = float_outputs(op, env)
        if not outs:
            return
        sync = torch.cuda.synchronize if outs[0].device.type == "cuda" else (lambda: None)
        key = codec_key(OUTLIER_CODEC, {"z_threshold": self.z_threshold})
        timed = time_codecs(op, env, {key}, _Unsized(), self.repeats, sync, self.log).get(OUTLIER_CODEC)
        if timed is not None:
            self.times[op.name] = (timed.compress_time_s, timed.decompress_time_s)

    def samples(self) -> dict[str, OpSample]:
        out = {}
        for name, per_layer in self.stats.items():
            first = per_layer[0]
            tc, td = self.times.get(name, (None, None))
            out[name] = OpSample(statistics.fmean(s.outlier_channels for s in per_layer), first.channels,
                                 first.shapes, first.dtype, tc, td, len(per_layer))
        return out


@contextlib.contextmanager
def _without_dropout(layers: Sequence[torch.nn.Module]) -> Iterator[None]:
    """``layers`` in eval mode, every module's own flag restored afterwards.

    The statistic is a Z-score over channel absolute sums, which dropout leaves unchanged in expectation (a kept
    value is scaled by 1 / (1 - p)): without it the probe reads that expectation instead of one noisy draw. And
    it must not cost memory the run does not have. Measured on cpu-deep (12 layers, micro-batch 12, the
    memory-efficient SDPA): with dropout the no-grad forward's resident size grew by two hidden-state tensors
    per layer (the two bias-dropout-adds) until the probe returned, 35 MiB over the 12 layers, so a tracking
    iteration peaked 8-11 MiB above a 600 MiB budget the training steps kept; without, the probe's own peak
    is 7 MiB above the step's resting size."""
    modules = [m for layer in layers for m in layer.modules()]
    flags = [m.training for m in modules]
    for m in modules:
        m.training = False
    try:
        yield
    finally:
        for m, flag in zip(modules, flags):
            m.training = flag


def sample_layers(runs: Sequence[LayerInputs], z_threshold: float, *, repeats: int = TIMING_REPEATS,
                  log: Callable[[str], None] | None = None) -> dict[str, OpSample]:
    """Run every layer of ``runs`` op by op (each run from its inputs, each layer on the previous one's output)
    and sample its outlier ops (see the module doc); codec times come from the last layer. Training's random
    streams and autograd are untouched."""
    from megatron.core.tensor_parallel.random import _fork_rng

    from megatron_adacc.adacc.runtime.ops import initial_env, layer_ops

    sampler = _Sampler(z_threshold, repeats, log or (lambda _msg: None))
    last = (len(runs) - 1, len(runs[-1].layers) - 1) if runs else None
    with _fork_rng(), torch.no_grad(), _without_dropout([layer for run in runs for layer in run.layers]):
        for r, run in enumerate(runs):
            hidden = run.hidden_states
            for i, layer in enumerate(run.layers):
                visit = functools.partial(sampler.visit, timed=(r, i) == last)
                env = initial_env(hidden, run.attention_mask, run.rotary_pos_emb)
                hidden = run_layer(layer_ops(layer), env, visit, tiles=run.tiles[i] if run.tiles else 1)
    return sampler.samples()


def merged(per_rank: Sequence[Mapping[str, OpSample]]) -> dict[str, OpSample]:
    """Every rank's samples as one: outlier counts averaged over all the layers sampled, codec times over the
    ranks that timed them. Merged in rank order, so every rank computes the same floats."""
    out: dict[str, OpSample] = {}
    for name in OUTLIER_OPS:
        found = [samples[name] for samples in per_rank if name in samples]
        if not found:
            continue
        layers = sum(s.layers for s in found)
        tc = [s.compress_time_s for s in found if s.compress_time_s is not None]
        td = [s.decompress_time_s for s in found if s.decompress_time_s is not None]
        out[name] = OpSample(sum(s.outlier_channels * s.layers for s in found) / layers, found[0].channels,
                             found[0].shapes, found[0].dtype, statistics.fmean(tc) if tc else None,
                             statistics.fmean(td) if td else None, layers)
    return out


def agreed(samples: Mapping[str, OpSample]) -> dict[str, OpSample]:
    """This rank's samples merged with every other rank's (one object all-gather, on tracking iterations only).

    Ranks see different layers (pipeline stages), different tensor shards and different data; each re-solves
    from what it is given, so they must be given the same, or two ranks could switch to different policies and
    wait forever in a collective of the backward."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        return dict(samples)
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, dict(samples))
    return merged(gathered)


# --------------------------------------------------------------------------------------------- capture
class _ChunkCapture:
    """Forward pre-hooks that hold one training micro-batch's inputs of one ``TransformerBlock``'s layers."""

    def __init__(self, block: torch.nn.Module):
        self.block = block
        self.hidden: torch.Tensor | None = None
        self.context: tuple[Any, Any] | None = None  # (attention_mask, rotary_pos_emb)
        self._signature = inspect.signature(block.forward)
        self._handles = [block.register_forward_pre_hook(self._on_block, with_kwargs=True),
                         block.layers[0].input_layernorm.register_forward_pre_hook(self._on_layernorm)]

    def _training(self) -> bool:
        return self.block.training and torch.is_grad_enabled()

    # Each training micro-batch replaces the last one's inputs: what is held once the step ends is the last
    # micro-batch's, whose backward has run by then. Holding the first one's would keep its layer input alive
    # through every later micro-batch, at the step's memory peak (measured: +1.5 MiB on tiny over 100 steps).
    def _on_block(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self._training():
            bound = self._signature.bind_partial(*args, **kwargs).arguments
            self.context = (bound.get("attention_mask"), bound.get("rotary_pos_emb"))

    def _on_layernorm(self, module: Any, args: tuple) -> None:
        if self.context is not None and self._training():
            self.hidden = args[0].detach()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def inputs(self) -> LayerInputs | None:
        from megatron_adacc.adacc.integration.dispatch import layer_tiles

        if self.hidden is None or self.context is None:
            return None
        return LayerInputs(list(self.block.layers), self.hidden, *self.context, tiles=layer_tiles(self.block))


class OutlierProbe:
    """Evolution's statistics source (:class:`~megatron_adacc.adacc.integration.evolution.StatsSource`): the
    outlier statistics of every op offering ``int4_outlier``, from this rank's layers (see the module doc)."""

    def __init__(self, z_threshold: float = 3.0, *, repeats: int = TIMING_REPEATS,
                 log: Callable[[str], None] | None = None):
        self.z_threshold = float(z_threshold)
        self.repeats = repeats
        self.log = log
        self._blocks: list[torch.nn.Module] = []
        self._captures: list[_ChunkCapture] = []

    def setup(self, model: Sequence[torch.nn.Module]) -> None:
        """Find the transformer blocks of this rank's model chunks (unwrapped), in order."""
        from megatron.core.transformer.transformer_block import TransformerBlock

        self._blocks = [m for chunk in model for m in chunk.modules()
                        if isinstance(m, TransformerBlock) and len(m.layers)]

    def arm(self) -> None:
        """Capture the inputs of the next training forward of each block (idempotent)."""
        if not self._captures:
            self._captures = [_ChunkCapture(block) for block in self._blocks]

    def measure(self, policy: Any = None) -> dict[str, OpSample]:
        """The statistics of the forward captured since :meth:`arm` (empty when none was); drops the capture."""
        captures, self._captures = self._captures, []
        for capture in captures:
            capture.remove()
        runs = [r for r in (c.inputs() for c in captures) if r is not None]
        del captures
        if not runs:
            return {}
        return sample_layers(runs, self.z_threshold, repeats=self.repeats, log=self.log)
