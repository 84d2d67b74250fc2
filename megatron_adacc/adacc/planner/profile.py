"""A layer profile made without running the layer: sizes from the fake run (:mod:`.sizing`), times from a GPU's
roofline (:mod:`.roofline`). The solver and the cost model take it as they take a measured one, so ``adacc plan``
predicts with the same model ``auto`` solves with."""

from __future__ import annotations

from typing import Any

from megatron_adacc.adacc.integration.profiler import sized_op_profile
from megatron_adacc.adacc.planner.roofline import memory_bound_seconds
from megatron_adacc.adacc.planner.sizing import FakeModel, op_times
from megatron_adacc.adacc.policy.ops import OPS, OUTLIER_CODEC
from megatron_adacc.adacc.policy.profile import CodecProfile, LayerProfile
from megatron_adacc.codecs.base import assumed_outlier_fraction
from megatron_adacc.core.gpus import GpuSpec


def codec_profile(saved_bytes: int, compressed_bytes: int, codec: str, gpu: GpuSpec | None) -> CodecProfile:
    """A codec on a GPU's roofline: compressing reads the tensor and writes what it keeps, decompressing the
    reverse; both only stream memory (no time without ``gpu``)."""
    seconds = memory_bound_seconds(saved_bytes + compressed_bytes, gpu) if gpu is not None else 0.0
    stats = {"assumed_outlier_fraction": assumed_outlier_fraction()} if codec == OUTLIER_CODEC else {}
    return CodecProfile(int(compressed_bytes), seconds, seconds, stats)


def planned_profile(model: FakeModel, micro_batch: int, gpu: GpuSpec, signature: dict[str, Any], *,
                    timed: bool = True) -> LayerProfile:
    """The profile of ``model``'s layer for a micro-batch of ``micro_batch`` on ``gpu`` (call inside the
    :func:`~.sizing.fake_tensors` block the model was built in). Its static memory and workspace are charged per
    pipeline stage (:func:`~megatron_adacc.adacc.integration.model_states.charge_static`). Without ``timed``, every
    time is 0: enough to tell what fits, which times do not change, at a third of the work."""
    sizes, keys = model.sizes(micro_batch)
    dtype = signature["dtype"]
    times = op_times(model.sample(micro_batch), gpu, dtype) if timed else {}
    ops = []
    for spec in OPS:
        op = sizes.ops[spec.name]
        codecs = {key[0]: codec_profile(op.saved_bytes, op.compressed_bytes[key], key[0], gpu if timed else None)
                  for key in keys[spec.name] if key in op.compressed_bytes}
        forward_s = times[spec.name].forward_s if timed else 0.0
        ops.append(sized_op_profile(spec.name, forward_s, codecs, keys[spec.name], op))
    # A GPU's RNG states (torch.cuda.get_rng_state) are host tensors: a recompute segment's copy takes no GPU memory.
    rng_bytes = 0 if model.target == "cuda" else sizes.rng_bytes
    return LayerProfile(device=f"plan:{gpu.name}", signature={**signature, "micro_batch_size": micro_batch}, ops=ops,
                        rng_bytes=int(rng_bytes),
                        step_time_s=sum(t.forward_s + t.backward_s for t in times.values()), source="planned",
                        meta={"target": model.target, "assumed_outlier_fraction": assumed_outlier_fraction(),
                              "ends_s": model.ends_seconds(micro_batch, gpu, dtype) if timed else 0.0})
