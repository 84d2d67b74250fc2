"""The model profiler (paper section 3.1): a short test run of one transformer layer with the user's
configuration, timed through the runtime's own op decomposition (:mod:`megatron_adacc.adacc.runtime.ops`).

Per op it records: the bytes its output holds for backward (the runtime's attribution, via
:func:`megatron_adacc.adacc.runtime.profile_layer_sizes`); the time to recompute it; the time to recompute every
segment ``a..b`` of consecutive ops from stored inputs; and, for every applicable codec, compress and
decompress time and compressed bytes on the real activations (outlier counts are data-dependent).
Static memory (parameters, gradients, optimizer states) and the logits workspace come from the model built on the
meta device (:mod:`megatron_adacc.adacc.integration.model_states`).

The profiler is handed the layer and its inputs (a :class:`LayerSample`); it builds no model and reads no data.
:mod:`megatron_adacc.adacc.integration.sample` makes the sample ``--adacc-policy auto`` profiles.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_adacc.adacc.policy.ops import OPS, OUTLIER_CODEC, Action
from megatron_adacc.adacc.policy.policy import DEFAULT_CODEC_PARAMS
from megatron_adacc.adacc.policy.profile import CodecProfile, LayerProfile, OpProfile, StashedOutput
from megatron_adacc.adacc.policy.signature import model_signature
from megatron_adacc.core.devices import resolve_device
from megatron_adacc.core.log import get_logger, progress

Sync = Callable[[], None]
CodecKeys = dict[str, set]  # op name -> {codec_key(name, params), ...}


@dataclass
class LayerSample:
    """What the profiler measures: one transformer layer of the model and real inputs for it."""

    layer: torch.nn.Module
    """A megatron-core ``TransformerLayer`` (local spec) of the configured shape, in training mode."""
    hidden: torch.Tensor
    """The hidden states entering the layer (detached): the embedding of a real batch."""
    mask: torch.Tensor | None
    """The attention mask the layer gets (Megatron's convention: True = masked out)."""
    rope: Any
    """Rotary embeddings, or None with learned positions."""


def device_name(device: torch.device | str | None = None) -> str:
    """A stable name for the profile database key: ``cuda:<GPU name>`` or ``cpu:<CPU model> x<cores>``."""
    device = resolve_device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu:{model} x{os.cpu_count()}"


#: On CUDA the budget is compared with the caching allocator's allocated bytes (``max_memory_allocated``), while
#: the device runs out when its *reserved* bytes meet what the CUDA context, NCCL and other processes leave. The
#: default budget keeps this fraction of that room for the gap between reserved and allocated (fragmentation of
#: the caching allocator, typically a few percent; more with varying shapes).
CUDA_DEFAULT_FRACTION = 0.9


def device_memory_bytes(device: torch.device | str | None = None) -> int:
    """The default budget. CUDA: :data:`CUDA_DEFAULT_FRACTION` of the memory PyTorch can have on the GPU (its
    total less what the CUDA context, NCCL and other processes hold now). CPU: the RAM available now."""
    device = resolve_device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside = total - free - torch.cuda.memory_reserved(device)  # held by anything but this caching allocator
        return int(CUDA_DEFAULT_FRACTION * (total - max(outside, 0)))
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the available memory; pass --adacc-memory-budget")


#: A measurement whose runs spread more than this (interquartile range over median) is repeated further: a
#: process beside the profiler (a test worker, a data loader, another job) makes single runs slow, and a profile
#: is stored and reused for every later run of the model.
STABLE_SPREAD = 0.25
#: ... up to this many times its ``repeats`` runs (and at least :data:`MIN_UNSTABLE_RUNS`), then it is counted
#: as unstable: a profile with many unstable measurements is flagged as measured under contention.
MAX_REPEAT_FACTOR = 4
MIN_UNSTABLE_RUNS = 9
#: The fraction of unstable measurements above which a profile is flagged.
CONTENDED_FRACTION = 0.2
#: The load per core above which a CPU profile is flagged: the profiler itself keeps one core busy, so more
#: than one runnable task per core means something else competed for them.
CONTENDED_LOAD = 1.0


@dataclass
class TimingNoise:
    """How stable the timings of one profiling run were (:func:`_timed` adds to the one :func:`profile_layer`
    opens)."""

    measurements: int = 0
    unstable: int = 0
    """Measurements still spread beyond :data:`STABLE_SPREAD` after their extra runs."""
    extra_runs: int = 0

    load_per_core: float | None = None
    """The system's load average per core when profiling ended (CPU profiles; None elsewhere): two profilers
    side by side time each other's work consistently, which no spread shows."""

    def contended(self) -> str | None:
        """Why the profile's timings cannot be trusted, or None."""
        if self.measurements and self.unstable / self.measurements > CONTENDED_FRACTION:
            return (f"{self.unstable} of {self.measurements} timings stayed spread over {STABLE_SPREAD:.0%} "
                    f"after {self.extra_runs} extra runs")
        if self.load_per_core is not None and self.load_per_core > CONTENDED_LOAD:
            return f"the load average was {self.load_per_core:.1f} per core"
        return None

    def to_json(self) -> dict[str, Any]:
        return {"measurements": self.measurements, "unstable": self.unstable, "extra_runs": self.extra_runs,
                "load_per_core": self.load_per_core}


def load_per_core() -> float | None:
    """The 1-minute load average over the cores this process may use (None where the system does not say)."""
    try:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return os.getloadavg()[0] / max(1, cores or 1)
    except OSError:
        return None


_NOISE: list[TimingNoise] = []


def spread(times: list[float]) -> float:
    """Interquartile range over median (0 for fewer than two runs or a zero median)."""
    if len(times) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / median if median > 0 else 0.0


def _timed(fn: Callable[[], Any], repeats: int, sync: Sync) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up, with ``repeats`` more at a time while
    the runs spread beyond :data:`STABLE_SPREAD` (up to :data:`MAX_REPEAT_FACTOR` times as many)."""
    fn()
    sync()
    times: list[float] = []
    limit = max(repeats * MAX_REPEAT_FACTOR, MIN_UNSTABLE_RUNS)
    while not times or (spread(times) > STABLE_SPREAD and len(times) < limit):
        for _ in range(max(1, min(repeats, limit - len(times)))):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
    if _NOISE:
        noise = _NOISE[-1]
        noise.measurements += 1
        noise.extra_runs += max(0, len(times) - repeats)
        noise.unstable += spread(times) > STABLE_SPREAD
    return statistics.median(times)


def codec_keys(args: Any) -> CodecKeys:
    """Every applicable codec of every op, with its default parameters (``--adacc-outlier-z`` for the
    outlier codec): what the profiler measures, so that the solver can offer any of them."""
    from megatron_adacc.adacc.runtime.memory import codec_key

    keys = {spec.name: {codec_key(c, DEFAULT_CODEC_PARAMS.get(c, {})) for c in spec.codecs} for spec in OPS}
    if getattr(args, "adacc_outlier_z", None):
        z = {"z_threshold": float(args.adacc_outlier_z)}
        keys = {op: {k if k[0] != OUTLIER_CODEC else codec_key(OUTLIER_CODEC, z) for k in op_keys}
                for op, op_keys in keys.items()}
    return keys


def measure_sizes(sample: LayerSample, keys: CodecKeys, log: Callable[[str], None]) -> tuple[Any, CodecKeys]:
    """Per-op saved and compressed bytes (the runtime's ``LayerSizes``) and the codecs that apply: a codec
    that refuses an op's tensors (e.g. bitmask on a float) is dropped for that op."""
    from megatron_adacc.adacc.runtime import profile_layer_sizes

    def sizes_for(codecs: CodecKeys):
        return profile_layer_sizes(sample.layer, sample.hidden, sample.mask, sample.rope, codecs=codecs)

    try:
        return sizes_for(keys), keys
    except (TypeError, ValueError):
        pass
    # measure codec by codec to find the ones that refuse
    sizes = sizes_for({})
    for op_name, op_keys in keys.items():
        for key in sorted(op_keys):
            try:
                one = sizes_for({op_name: {key}})
            except (TypeError, ValueError) as e:
                log(f"profile: codec {key[0]} does not apply to {op_name}'s tensors ({e}); skipped")
                continue
            sizes.ops[op_name].compressed_bytes[key] = one.ops[op_name].compressed_bytes[key]
    return sizes, {op: set(sizes.ops[op].compressed_bytes) for op in keys}


def _no_tick() -> None:
    pass


def time_ops(ops: list, env: dict, repeats: int, sync: Sync, tick: Callable[[], Any] = _no_tick) -> list[float]:
    """Forward time of each op from the stored inputs in ``env`` (one full forward's environment); ``tick()``
    after each (a progress bar)."""
    times = []
    for op in ops:
        times.append(_timed(lambda op=op: op.run(dict(env)), repeats, sync))
        tick()
    return times


def segment_count(n: int, max_segment_ops: int | None) -> int:
    """How many segments :func:`time_segments` times for ``n`` ops."""
    longest = n if max_segment_ops is None else max_segment_ops
    return sum(min(n, a + longest) - a for a in range(1, n))


def time_segments(ops: list, env: dict, repeats: int, sync: Sync, max_segment_ops: int | None,
                  tick: Callable[[], Any] = _no_tick) -> dict[tuple[int, int], float]:
    """Recompute time of every segment ``a..b`` (``1 <= a <= b``, at most ``max_segment_ops`` ops long) from
    the stored inputs in ``env``; ``tick()`` after each. Op 0 is never recomputed: the layer's input is always
    kept."""
    from megatron_adacc.adacc.runtime import run_ops

    n = len(ops)
    longest = n if max_segment_ops is None else max_segment_ops
    segments: dict[tuple[int, int], float] = {}
    for a in range(1, n):
        for b in range(a, min(n, a + longest)):
            segments[(a, b)] = _timed(lambda a=a, b=b: run_ops(ops[a:b + 1], dict(env)), max(1, repeats - 1), sync)
            tick()
    return segments


def float_outputs(op: Any, env: dict) -> list[torch.Tensor]:
    """The op's outputs a codec compresses: floating-point activations (no bias Parameters, no None)."""
    return [env[name] for name in op.outputs if isinstance(env[name], torch.Tensor)
            and not isinstance(env[name], torch.nn.Parameter) and env[name].is_floating_point()]


def time_codecs(op: Any, env: dict, keys: set, sizes: Any, repeats: int, sync: Sync,
                log: Callable[[str], None]) -> dict[str, CodecProfile]:
    """Compress and decompress time of each codec in ``keys`` on ``op``'s floating-point outputs in ``env``,
    with the compressed bytes the runtime attributed (``sizes``: the op's ``OpSizes``)."""
    from megatron_adacc.codecs import get_codec

    outs = float_outputs(op, env)
    codecs: dict[str, CodecProfile] = {}
    for key in keys:
        name, params = key[0], dict(key[1])
        codec = get_codec(name, **params)
        try:
            packed = [codec.compress(x.detach()) for x in outs]
        except (TypeError, ValueError) as e:
            # the runtime would keep what this codec refuses; offer the MILP no such choice
            log(f"profile: codec {name} does not apply to {op.name}'s output ({e}); skipped")
            continue
        tc = _timed(lambda c=codec, xs=outs: [c.compress(x.detach()) for x in xs], repeats, sync) if outs else 0.0
        td = _timed(lambda c=codec, ps=packed: [c.decompress(p) for p in ps], repeats, sync) if outs else 0.0
        stats: dict[str, Any] = {}
        if name == OUTLIER_CODEC and packed:
            k = sum(int(p.tensors["index"].numel()) for p in packed if "index" in p.tensors)
            stats = {"outlier_channels": k, "channels": sum(int(x.shape[-1]) for x in outs)}
        codecs[name] = CodecProfile(int(sizes.compress_cost(key)), tc, td, stats)
    return codecs


def leaf_copies(op: Any, env: dict) -> dict:
    """``op``'s inputs from ``env`` as copies of fresh leaves, to run its backward alone: the backward must not reach
    the ops before it, and softmax masks its input in place, which a leaf refuses (hence copies)."""
    return {name: env[name].detach().requires_grad_(env[name].requires_grad).clone()
            if isinstance(env[name], torch.Tensor) and not isinstance(env[name], torch.nn.Parameter)
            else env[name] for name in op.inputs}


def backward_transient(op: Any, env: dict, device: torch.device, repeats: int) -> int | None:
    """The bytes ``op``'s backward has live beyond what the forward saved: the gradient arriving for its outputs,
    the gradients it writes for what it reads and its own temporaries (a softmax's backward holds two more
    tensors of its size). The median of ``repeats`` measured backwards; None where memory cannot be measured."""
    from megatron_adacc.adacc.runtime.stages import transient_bytes

    found = []
    for _ in range(max(1, repeats)):
        with torch.enable_grad():
            outs = [v for v in op.run(leaf_copies(op, env)).values() if isinstance(v, torch.Tensor)
                    and v.requires_grad and not isinstance(v, torch.nn.Parameter)]
        if not outs:
            return 0
        grads = [torch.ones_like(v) for v in outs]
        peak = transient_bytes(lambda o=outs, g=grads: torch.autograd.backward(o, g), device)
        if peak is None:
            return None
        found.append(peak + sum(g.untyped_storage().nbytes() for g in grads))
        del outs, grads
        op.layer.zero_grad(set_to_none=True)
    return int(statistics.median(found))


def forward_transient(op: Any, env: dict, device: torch.device, repeats: int) -> int | None:
    """The bytes ``op``'s forward has live at its peak beyond its inputs: its outputs, what autograd saves of what
    it makes (a dropout's mask), its temporaries. The median of ``repeats`` measured forwards; None where memory
    cannot be measured."""
    from megatron_adacc.adacc.runtime.stages import transient_bytes

    found = []
    for _ in range(max(1, repeats)):
        inputs = leaf_copies(op, env)

        def run(inputs: dict = inputs) -> None:
            with torch.enable_grad():
                op.run(inputs)  # the outputs and their graph die on return, after the peak was read

        peak = transient_bytes(run, device)
        if peak is None:
            return None
        found.append(peak)
        del inputs
    return int(statistics.median(found))


def op_profile(op: Any, forward_s: float, env: dict, keys: set, sizes: Any, repeats: int, sync: Sync,
               log: Callable[[str], None]) -> OpProfile:
    """One op's profile: its saved bytes, forward time, codecs (timed), per-codec stash bytes, readers, and the
    gradients of its backward by their sizes (:func:`backward_transient` measures them where it can)."""
    return sized_op_profile(op.name, forward_s, time_codecs(op, env, keys, sizes, repeats, sync, log), keys, sizes)


def sized_op_profile(name: str, forward_s: float, codecs: dict[str, CodecProfile], keys: set, sizes: Any
                     ) -> OpProfile:
    """An op's profile from the runtime's sizes of it (``OpSizes``), its forward time and its codecs' profiles
    (measured here; a roofline's in ``adacc plan``): stash bytes per codec, readers, what is freed when."""
    stash = []
    for out, kept in sizes.stash_keep_bytes.items():
        held = {"keep": int(kept)}
        held.update({key[0]: int(sizes.stash_compressed_bytes[out].get(key, 0)) for key in keys if key[0] in codecs})
        stash.append(StashedOutput(tuple(sizes.readers.get(out, ())), held, int(sizes.value_bytes[out])))
    return OpProfile(name, int(sizes.saved_bytes), float(forward_s), codecs, stash, dict(sizes.consumer_bytes),
                     int(sizes.grad_bytes), dict(sizes.freed_bytes), int(sizes.output_bytes))


#: Calibration factors are clamped to this range: below it timing noise dominates, above it something is wrong
#: enough (a loaded machine) that trusting it would make the MILP avoid a choice for no reason.
_SCALE_RANGE = (0.5, 20.0)


#: Rounds of the calibration's alternation (at least; more with more ``repeats``): one run of each variant per
#: round, the overheads the medians of the rounds' paired differences.
CALIBRATION_ROUNDS = 7


def calibrate(sample: LayerSample, op_profiles: list[OpProfile], segments: dict[tuple[int, int], float],
              fwd: list[float], repeats: int, sync: Sync) -> tuple[float, float, float, float, float]:
    """Time one layer's forward + backward under the runtime with every op kept, compressed and recomputed,
    and through megatron's own forward, plain and under its full recompute; return (codec scale, recompute
    scale, stock time, runtime overhead, megatron's recompute): the first two are measured overheads over the sums
    the cost model would predict from the per-op micro-benchmarks, the fourth the runtime's fixed cost (keep-all
    in the runtime against the stock layer), the last what megatron's full recompute of the layer adds to its
    stock step (:attr:`LayerProfile.layer_recompute_s`: a policy recomputing the whole layer runs it).

    The five variants run in alternating rounds, and each overhead is the median over the rounds of the
    difference between two runs of one round. Timed one variant after the other, a host that slows down for a
    few seconds (a shared machine does) charged it all to one variant: two profiles of cpu-large's layer made
    minutes apart on one host read codec times x20 (the clamp) with no runtime overhead, and x0.5 with 53 ms of
    it, and the solver then never compressed, or compressed everything."""
    from megatron.core.tensor_parallel.random import _fork_rng

    from megatron_adacc.adacc.policy.policy import Policy
    from megatron_adacc.adacc.runtime import checkpointed_layer_forward
    from megatron_adacc.adacc.runtime.checkpoint import recomputed_layer_forward, stock_layer_forward

    layer, mask, rope = sample.layer, sample.mask, sample.rope

    def decomposed(decisions) -> Callable[..., torch.Tensor]:
        return lambda *inputs: checkpointed_layer_forward(layer, decisions, *inputs)

    quant_policy = Policy.quantize_all(1).layer_decisions(0)
    variants = {"stock": functools.partial(stock_layer_forward, layer),
                "keep": decomposed(Policy.all_keep(1).layer_decisions(0)), "quant": decomposed(quant_policy),
                "recompute": decomposed(Policy.preset("all-recompute", 1).layer_decisions(0)),
                "megatron": functools.partial(recomputed_layer_forward, layer)}

    def step(name: str) -> None:
        out = variants[name](sample.hidden.detach().requires_grad_(True), mask, rope)
        out.backward(torch.ones_like(out))
        layer.zero_grad(set_to_none=True)

    with _fork_rng():  # dropout draws here must not move the training's random streams
        rounds = alternating_rounds(step, list(variants), max(CALIBRATION_ROUNDS, 2 * repeats + 1), sync)
    stock = statistics.median(r["stock"] for r in rounds)
    keep_over_stock, quant_over_keep, recompute_over_keep, megatron_over_stock = (
        paired_median(rounds, a, b) for a, b in (("keep", "stock"), ("quant", "keep"), ("recompute", "keep"),
                                                 ("megatron", "stock")))
    modeled_codec = sum(op.codecs[d.codec].compress_time_s + op.codecs[d.codec].decompress_time_s
                        for op, d in ((op, quant_policy[op.name]) for op in op_profiles)
                        if d.action == Action.COMPRESS and d.codec in op.codecs)
    n = len(fwd)
    modeled_recompute = segments.get((1, n - 1), sum(fwd[1:]))
    lo, hi = _SCALE_RANGE

    def scale(measured: float, modeled: float) -> float:
        return 1.0 if modeled <= 0 else min(hi, max(lo, measured / modeled))

    return (scale(quant_over_keep, modeled_codec), scale(recompute_over_keep, modeled_recompute), stock,
            max(0.0, keep_over_stock), max(0.0, megatron_over_stock))


def tile_overhead(layer: torch.nn.Module, ln2: torch.Tensor, tiles: int, repeats: int, sync: Sync) -> float:
    """The tiled MLP re-run's cost per tile beyond the first (:attr:`LayerProfile.tile_overhead_s`): its block's
    forward + backward in ``tiles`` tiles against the same block in one, in alternating rounds, on
    ``pre_mlp_layernorm``'s output ``ln2``. 0 for ``tiles`` < 2."""
    from megatron.core.tensor_parallel.random import _fork_rng

    from megatron_adacc.adacc.runtime.ops import mlp_functions
    from megatron_adacc.adacc.runtime.tiled import tiled_mlp

    if tiles < 2:
        return 0.0
    fns = mlp_functions(layer)

    def run(name: str) -> None:
        x = ln2.detach().requires_grad_(True)
        out = tiled_mlp(layer, x, tiles if name == "tiled" else 1, fns)["fc2_out"]
        out.backward(torch.ones_like(out))
        layer.zero_grad(set_to_none=True)

    with _fork_rng():
        rounds = alternating_rounds(run, ["whole", "tiled"], max(CALIBRATION_ROUNDS, 2 * repeats + 1), sync)
    return max(0.0, paired_median(rounds, "tiled", "whole") / (tiles - 1))


def paired_median(rounds: Sequence[dict[str, float]], a: str, b: str) -> float:
    """The median over :func:`alternating_rounds`' rounds of ``a``'s time minus ``b``'s in the same round."""
    return statistics.median(r[a] - r[b] for r in rounds)


def alternating_rounds(run: Callable[[str], Any], names: Sequence[str], rounds: int, sync: Sync,
                       clock: Callable[[], float] = time.perf_counter) -> list[dict[str, float]]:
    """Wall times of ``run(name)`` for every name, one run each per round, the names in turn, after one warm-up
    of each: ``[{name: seconds}]`` per round, so that differences are taken between runs moments apart."""
    for name in names:
        run(name)
    sync()
    out = []
    for _ in range(rounds):
        times = {}
        for name in names:
            t0 = clock()
            run(name)
            sync()
            times[name] = clock() - t0
        out.append(times)
    if _NOISE:
        noise = _NOISE[-1]
        for name in names:
            noise.measurements += 1
            noise.unstable += spread([r[name] for r in out]) > STABLE_SPREAD
    return out


@dataclass
class _Measured:
    """Everything :func:`profile_layer` measured, before it becomes a :class:`LayerProfile`."""

    sizes: Any  # the runtime's LayerSizes
    ops: list[OpProfile]
    forward_s: list[float]
    segments: dict[tuple[int, int], float]
    calibration: tuple[float, float, float, float, float]  # what calibrate() returns
    tile_overhead_s: float = 0.0


def profile_layer(sample: LayerSample, args: Any, config: Any, *, device: torch.device | str | None = None,
                  repeats: int = 3, max_segment_ops: int | None = None, log: Callable[[str], None] | None = None
                  ) -> LayerProfile:
    """Profile ``sample.layer`` on ``sample``'s inputs, for the model ``args``/``config`` describe.

    ``device`` names the profile (default: where the sample's inputs are). ``max_segment_ops`` bounds the
    measured segment length (longer segments are estimated from per-op times plus the measured per-segment
    overhead), to keep profiling short on large layers. Assumes torch.distributed and megatron's parallel
    state are initialized (``adacc train`` and ``adacc profile`` do it). Timings are repeated until they agree
    (:func:`_timed`); a profile whose timings would not is flagged in ``meta["contended"]``.
    """
    log = log or (lambda _msg: None)
    _NOISE.append(TimingNoise())
    try:
        profile = _profile_layer(sample, args, config, device, repeats, max_segment_ops, log)
    finally:
        noise = _NOISE.pop()
    if profile.device.startswith("cpu"):
        noise.load_per_core = load_per_core()
    profile.meta["timing"] = noise.to_json()
    contended = noise.contended()
    if contended:
        profile.meta["contended"] = contended
        get_logger().warning(f"profile: measured under contention ({contended}); it is stored and flagged: rerun "
                             "`adacc profile --refresh` with the same flags on a quiet machine")
    return profile


def _profile_layer(sample: LayerSample, args: Any, config: Any, device: torch.device | str | None, repeats: int,
                   max_segment_ops: int | None, log: Callable[[str], None]) -> LayerProfile:
    from megatron.core.tensor_parallel.random import _fork_rng

    from megatron_adacc.adacc.integration.model_states import charge_static
    from megatron_adacc.adacc.runtime import layer_ops
    from megatron_adacc.adacc.runtime.ops import initial_env

    device = torch.device(device) if device is not None else sample.hidden.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    signature = model_signature(config, args)
    log("profile: per-op saved and compressed bytes")
    sizes, keys = measure_sizes(sample, codec_keys(args), log)
    ops = layer_ops(sample.layer)
    # One bar over every timed measurement: op forwards, segments, codecs, the calibration, the tiled MLP, op
    # backwards.
    with progress(total=3 * len(ops) + segment_count(len(ops), max_segment_ops) + 2, desc="profile",
                  unit="step") as bar:
        with _fork_rng(), torch.enable_grad():
            env = initial_env(sample.hidden.detach().requires_grad_(True), sample.mask, sample.rope)
            for op in ops:
                env.update(op.run(env))
            log("profile: per-op forward times")
            fwd = time_ops(ops, env, repeats, sync, bar.update)
            log("profile: recompute segment times")
            segments = time_segments(ops, env, repeats, sync, max_segment_ops, bar.update)
        log("profile: codec times")
        op_profiles = []
        for spec, op, t in zip(OPS, ops, fwd):
            op_profiles.append(op_profile(op, t, env, keys[spec.name], sizes.ops[spec.name], repeats, sync, log))
            bar.update()
        log("profile: calibrating codec and recompute times inside the runtime")
        calibration = calibrate(sample, op_profiles, segments, fwd, repeats, sync)
        bar.update()
        codec_scale, recompute_scale, keep_step, runtime_overhead, megatron_recompute = calibration
        log(f"profile: codec times x{codec_scale:.2f}, recompute times x{recompute_scale:.2f}, runtime "
            f"{runtime_overhead * 1e3:.2f} ms per layer ({runtime_overhead / keep_step:.1%} of its stock step), "
            f"megatron's recompute of it {megatron_recompute * 1e3:.2f} ms")
        tiles = int(getattr(args, "adacc_mlp_tiles", 8) or 1)
        per_tile = tile_overhead(sample.layer, env["ln2"], tiles, repeats, sync)
        bar.update()
        log(f"profile: an MLP re-run in {tiles} tiles costs {per_tile * 1e3:.2f} ms per tile beyond the first")
        # last: measuring memory on the CPU sets the allocator to return what is freed, which slows allocation
        log("profile: memory of each op's forward and backward")
        with _fork_rng():
            for op, profiled in zip(ops, op_profiles):
                measured = backward_transient(op, env, device, repeats)
                if measured is not None:
                    profiled.grad_bytes = measured
                profiled.forward_bytes = forward_transient(op, env, device, repeats)
                bar.update()
    measured = _Measured(sizes, op_profiles, fwd, segments, calibration, per_tile)
    return charge_static(_layer_profile(args, signature, device, measured, repeats), args, config)


def _layer_profile(args: Any, signature: dict[str, Any], device: torch.device, measured: _Measured,
                   repeats: int) -> LayerProfile:
    """The stored profile: the measurements (its static memory and logits workspace are charged by
    :func:`~megatron_adacc.adacc.integration.model_states.charge_static`)."""
    codec_scale, recompute_scale, keep_step, runtime_overhead, megatron_recompute = measured.calibration
    fwd, segments = measured.forward_s, measured.segments
    overheads = [segments[(a, a)] - fwd[a] for a in range(1, len(fwd)) if (a, a) in segments]
    return LayerProfile(
        device=device_name(device), signature=signature, ops=measured.ops,
        rng_bytes=int(measured.sizes.rng_bytes),
        segment_times_s=segments,
        segment_overhead_s=max(0.0, statistics.median(overheads)) if overheads else 0.0,
        step_time_s=keep_step, codec_time_scale=codec_scale, recompute_time_scale=recompute_scale,
        runtime_overhead_s=runtime_overhead, tile_overhead_s=measured.tile_overhead_s,
        layer_recompute_s=megatron_recompute, source="measured",
        meta={"repeats": repeats, "torch": torch.__version__},
    )
