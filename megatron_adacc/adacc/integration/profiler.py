"""The model profiler (paper section 3.1): a short test run of one transformer layer with the user's
configuration, timed through the runtime's own op decomposition (:mod:`megatron_adacc.adacc.runtime.ops`).

Per op it records: the bytes its output holds for backward (the runtime's attribution, via
:func:`megatron_adacc.adacc.runtime.profile_layer_sizes`); the time to recompute it; the time to recompute every
segment ``a..b`` of consecutive ops from stored inputs; and, for every applicable codec, compress and
decompress time and compressed bytes on the real activations (outlier counts are data-dependent).
Static memory (parameters, gradients, optimizer states) is computed from the parameter count.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from megatron_adacc.adacc.policy.ops import OPS, OUTLIER_CODEC
from megatron_adacc.adacc.policy.policy import DEFAULT_CODEC_PARAMS
from megatron_adacc.adacc.policy.profile import CodecProfile, LayerProfile, OpProfile
from megatron_adacc.adacc.policy.signature import model_signature


def device_name(device: torch.device | str | None = None) -> str:
    """A stable name for the profile database key: ``cuda:<GPU name>`` or ``cpu:<CPU model> x<cores>``."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
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


def device_memory_bytes(device: torch.device | str | None = None) -> int:
    """The default budget: the GPU's total memory, or the RAM available now on CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read the available memory; pass --adacc-memory-budget")


def _timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def static_bytes_per_param(args: Any) -> int:
    """Parameters + Megatron DDP's fp32 gradient buffer + Adam's two fp32 moments (+ fp32 master copy
    when training in bf16/fp16)."""
    if getattr(args, "bf16", False) or getattr(args, "fp16", False):
        return 2 + 4 + 4 + 8
    return 4 + 4 + 8


def _layer_inputs(model: torch.nn.Module, args: Any, device: torch.device):
    """Real hidden states entering layer 0 (embedding of a corpus batch), the mask, and rotary embeddings."""
    from megatron_adacc.training.data import BatchSampler

    batch = next(iter(BatchSampler(args.seq_length, args.micro_batch_size, getattr(args, "seed", 1234),
                                   corpus=getattr(args, "corpus", "embedded"))))
    tokens = batch.tokens.to(device)
    positions = batch.position_ids.to(device)
    gpt = model.module if hasattr(model, "module") and not hasattr(model, "embedding") else model
    with torch.no_grad():
        hidden = gpt.embedding(input_ids=tokens, position_ids=positions)
    rope = None
    if getattr(gpt, "rotary_pos_emb", None) is not None:
        rope = gpt.rotary_pos_emb(args.seq_length)
    mask = batch.attention_mask.to(device) if batch.attention_mask is not None else None
    return gpt, hidden.detach(), mask, rope


#: Calibration factors are clamped to this range: below it timing noise dominates, above it something is wrong
#: enough (a loaded machine) that trusting it would make the MILP avoid a choice for no reason.
_SCALE_RANGE = (0.5, 20.0)


def _calibrate(layer, hidden, mask, rope, op_profiles, segments, fwd, repeats, sync
               ) -> tuple[float, float, float, float]:
    """Time one layer's forward + backward under the runtime with every op kept, compressed and recomputed,
    and through megatron's own forward; return (codec scale, recompute scale, stock time, runtime overhead):
    the first two are measured overheads over the sums the cost model would predict from the per-op
    micro-benchmarks, the last the runtime's fixed cost (keep-all in the runtime against the stock layer)."""
    from megatron.core.tensor_parallel.random import _fork_rng

    from megatron_adacc.adacc.policy.policy import Policy
    from megatron_adacc.adacc.runtime import checkpointed_layer_forward
    from megatron_adacc.adacc.runtime.checkpoint import stock_layer_forward

    def step(decisions) -> None:
        x = hidden.detach().requires_grad_(True)
        if decisions is None:
            out = stock_layer_forward(layer, x, mask, rope)
        else:
            out = checkpointed_layer_forward(layer, decisions, x, mask, rope)
        out.backward(torch.ones_like(out))
        layer.zero_grad(set_to_none=True)

    def timed(policy: Policy | None) -> float:
        decisions = policy.layer_decisions(0) if policy is not None else None
        with _fork_rng():
            return _timed(lambda: step(decisions), max(3, repeats), sync)

    stock = timed(None)
    keep = timed(Policy.all_keep(1))
    quant = timed(Policy.quantize_all(1))
    recompute = timed(Policy.preset("all-recompute", 1))
    quant_policy = Policy.quantize_all(1).layer_decisions(0)
    modeled_codec = sum(op.codecs[d.codec].compress_time_s + op.codecs[d.codec].decompress_time_s
                        for op, d in ((op, quant_policy[op.name]) for op in op_profiles)
                        if d.action == "compress" and d.codec in op.codecs)
    n = len(fwd)
    modeled_recompute = segments.get((1, n - 1), sum(fwd[1:]))
    lo, hi = _SCALE_RANGE

    def scale(measured: float, modeled: float) -> float:
        return 1.0 if modeled <= 0 else min(hi, max(lo, measured / modeled))

    return (scale(quant - keep, modeled_codec), scale(recompute - keep, modeled_recompute), stock,
            max(0.0, keep - stock))


def profile_layer(args: SimpleNamespace, config: Any, *, device: torch.device | str | None = None,
                  repeats: int = 3, max_segment_ops: int | None = None, log: Callable[[str], None] | None = None
                  ) -> LayerProfile:
    """Profile one transformer layer of the model ``args``/``config`` describe.

    ``max_segment_ops`` bounds the measured segment length (longer segments are estimated from per-op
    times plus the measured per-segment overhead), to keep profiling short on large layers.
    Assumes torch.distributed and megatron's parallel state are initialized (``adacc train`` and
    ``adacc profile`` do it).
    """
    from megatron.core.tensor_parallel.random import _fork_rng

    from megatron_adacc.adacc.runtime import layer_ops, profile_layer_sizes, run_ops
    from megatron_adacc.adacc.runtime.memory import codec_key
    from megatron_adacc.adacc.runtime.ops import initial_env
    from megatron_adacc.codecs import get_codec
    from megatron_adacc.training import model as model_lib

    log = log or (lambda _msg: None)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    signature = model_signature(config, args)

    # A one-layer model with the same configuration: same layer, embeddings for realistic inputs.
    one_args = copy.copy(args)
    one_args.num_layers = 1
    one_config = copy.copy(config)
    one_config.num_layers = 1
    one_config.recompute_granularity = None
    one_config.recompute_method = None
    one_config.recompute_num_layers = None
    model = model_lib.build_gpt(one_args, one_config).to(device)
    model.train()
    gpt, hidden, mask, rope = _layer_inputs(model, args, device)
    layer = gpt.decoder.layers[0]

    codecs_by_op = {spec.name: {codec_key(c, DEFAULT_CODEC_PARAMS.get(c, {})) for c in spec.codecs} for spec in OPS}
    if getattr(args, "adacc_outlier_z", None):
        z = {"z_threshold": float(args.adacc_outlier_z)}
        codecs_by_op = {op: {k if k[0] != OUTLIER_CODEC else codec_key(OUTLIER_CODEC, z) for k in keys}
                        for op, keys in codecs_by_op.items()}
    log("profile: per-op saved and compressed bytes")
    try:
        sizes = profile_layer_sizes(layer, hidden, mask, rope, codecs=codecs_by_op)
    except (TypeError, ValueError):
        # some codec refuses some op's tensors (e.g. bitmask on a float): measure codec by codec, drop those
        sizes = profile_layer_sizes(layer, hidden, mask, rope, codecs={})
        for op_name, keys in codecs_by_op.items():
            for key in sorted(keys):
                try:
                    one = profile_layer_sizes(layer, hidden, mask, rope, codecs={op_name: {key}})
                except (TypeError, ValueError) as e:
                    log(f"profile: codec {key[0]} does not apply to {op_name}'s tensors ({e}); skipped")
                    continue
                sizes.ops[op_name].compressed_bytes[key] = one.ops[op_name].compressed_bytes[key]
        codecs_by_op = {op: set(sizes.ops[op].compressed_bytes) for op in codecs_by_op}

    ops = layer_ops(layer)
    inputs = hidden.detach().requires_grad_(True)
    with _fork_rng(), torch.enable_grad():
        env = initial_env(inputs, mask, rope)
        for op in ops:
            env.update(op.run(env))

        log("profile: per-op forward times")
        fwd = [_timed(lambda op=op: op.run(dict(env)), repeats, sync) for op in ops]
        n = len(ops)
        segments: dict[tuple[int, int], float] = {}
        longest = n if max_segment_ops is None else max_segment_ops
        log("profile: recompute segment times")
        for a in range(1, n):
            for b in range(a, min(n, a + longest)):
                segments[(a, b)] = _timed(lambda a=a, b=b: run_ops(ops[a:b + 1], dict(env)), max(1, repeats - 1), sync)

    overheads = [segments[(a, a)] - fwd[a] for a in range(1, n) if (a, a) in segments]
    op_profiles = []
    log("profile: codec times")
    for spec, op, t in zip(OPS, ops, fwd):
        s = sizes.ops[spec.name]
        outs = [env[name] for name in op.outputs if isinstance(env[name], torch.Tensor)
                and not isinstance(env[name], torch.nn.Parameter) and env[name].is_floating_point()]
        codecs: dict[str, CodecProfile] = {}
        for key in codecs_by_op[spec.name]:
            name, params = key[0], dict(key[1])
            codec = get_codec(name, **params)
            try:
                packed = [codec.compress(x.detach()) for x in outs]
            except (TypeError, ValueError) as e:
                # the runtime would keep what this codec refuses; offer the MILP no such choice
                log(f"profile: codec {name} does not apply to {spec.name}'s output ({e}); skipped")
                continue
            tc = _timed(lambda c=codec, xs=outs: [c.compress(x.detach()) for x in xs], repeats, sync) if outs else 0.0
            td = _timed(lambda c=codec, ps=packed: [c.decompress(p) for p in ps], repeats, sync) if outs else 0.0
            stats: dict[str, Any] = {}
            if name == OUTLIER_CODEC and packed:
                k = sum(int(p.tensors["index"].numel()) for p in packed if "index" in p.tensors)
                stats = {"outlier_channels": k, "channels": sum(int(x.shape[-1]) for x in outs)}
            codecs[name] = CodecProfile(int(s.compress_cost(key)), tc, td, stats)
        stash = {"keep": int(sum(s.stash_keep_bytes.values()))}
        for key in codecs_by_op[spec.name]:
            if key[0] not in codecs:
                continue
            stash[key[0]] = int(sum(per.get(key, 0) for per in s.stash_compressed_bytes.values()))
        if s.saved_bytes == 0:
            # nothing of this op is saved for backward: compressing it costs no time (only a stash would)
            codecs = {k: CodecProfile(v.compressed_bytes, 0.0, 0.0, v.stats) for k, v in codecs.items()}
        op_profiles.append(OpProfile(spec.name, int(s.saved_bytes), float(t), codecs, stash))

    log("profile: calibrating codec and recompute times inside the runtime")
    codec_scale, recompute_scale, keep_step, runtime_overhead = _calibrate(
        layer, hidden, mask, rope, op_profiles, segments, fwd, repeats, sync)
    log(f"profile: codec times x{codec_scale:.2f}, recompute times x{recompute_scale:.2f}, runtime "
        f"{runtime_overhead * 1e3:.2f} ms per layer ({runtime_overhead / keep_step:.1%} of its stock step)")

    layer_params = sum(p.numel() for p in layer.parameters())
    model_params = sum(p.numel() for p in model.parameters())
    total_params = model_params + (signature["num_layers"] - 1) * layer_params
    # The policy-independent transient: the logits and their gradient (vocab x tokens, fp32), live around the
    # loss. What a layer re-materializes in its backward depends on the policy; the cost model adds it.
    vocab = getattr(gpt, "vocab_size", 0) or 0
    workspace = 2 * 4 * vocab * args.seq_length * args.micro_batch_size
    return LayerProfile(
        device=device_name(device), signature=signature, ops=op_profiles,
        static_bytes=int(total_params * static_bytes_per_param(args)),
        workspace_bytes=int(workspace + sizes.rng_bytes),
        layer_fixed_bytes=int(sizes.input_bytes),
        rng_bytes=int(sizes.rng_bytes),
        segment_times_s=segments,
        segment_overhead_s=max(0.0, statistics.median(overheads)) if overheads else 0.0,
        step_time_s=keep_step, codec_time_scale=codec_scale, recompute_time_scale=recompute_scale,
        runtime_overhead_s=runtime_overhead,
        source="measured",
        meta={"repeats": repeats, "total_params": int(total_params), "torch": torch.__version__},
    )
