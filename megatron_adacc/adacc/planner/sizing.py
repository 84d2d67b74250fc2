"""A full-size layer sized without allocating it: megatron-core's own ``TransformerLayer``, built on fake tensors
(PyTorch's ``FakeTensorMode``) as one rank of a parallel layout builds it, and run through the Adacc runtime's
decomposition and its attribution of saved tensors to ops (:func:`~megatron_adacc.adacc.runtime.profile_layer_sizes`,
the profiler's :func:`~megatron_adacc.adacc.integration.profiler.measure_sizes`). The bytes are the ones the runtime
would hold, by the same code: a change to the decomposition or to a codec's routing changes them with no edit here.
The same run times every op on a GPU's roofline (:mod:`.roofline`).

``target`` says whose kernels the sizes follow. ``cpu``: the CPU's, exactly what ``adacc train`` measures here.
``cuda``: two kernels save other tensors on a GPU, and the fake run takes the GPU's path for both:

* dropout: ``native_dropout`` keeps a bool mask (1 byte a value) where the CPU's dropout keeps its float multiplier
  (:class:`_NativeDropout` routes ``F.dropout`` to ``native_dropout``, which the CPU has too);
* attention probabilities: Megatron-LM's default fused masked softmax (``--masked-softmax-fusion``) stores them in
  the 16-bit type it trains in, where megatron-core's unfused path, with ``attention_softmax_in_fp32``, keeps
  fp32 ones: the fake run computes the softmax in 16 bits, which saves the same bytes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megatron_adacc.adacc.integration.profiler import LayerSample, codec_keys, leaf_copies, measure_sizes
from megatron_adacc.adacc.planner.layout import Layout, fake_groups
from megatron_adacc.adacc.planner.roofline import Roofline
from megatron_adacc.core.gpus import GpuSpec

TARGETS = ("cpu", "cuda")


class _NativeDropout(TorchFunctionMode):
    """Training dropout as a GPU runs it: ``native_dropout``, whose autograd node keeps a bool mask."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p = args[0], kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and 0 < p < 1 and not kwargs.get("inplace", False):
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_tensors(target: str = "cpu") -> Iterator[Any]:
    """Everything created inside is a fake tensor, with ``target``'s kernels (module docstring).

    megatron's global memory buffer, which keeps the tensor the attention scores are written into across calls, is
    replaced for the duration: a fake tensor must not outlive its mode, nor a real run find one there."""
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer
    from torch._subclasses.fake_tensor import FakeTensorMode

    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    kept = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            with _NativeDropout() if target == "cuda" else contextlib.nullcontext():
                yield mode
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = kept


class _NormWithoutSequenceParallel:
    """A local-spec norm under sequence parallelism: megatron-core's torch norms refuse it, though a norm acts on
    each token alone, so its activations (the per-token statistics of its shard of the sequence) are the same.
    Built with the layer's config less ``sequence_parallel``; for sizing only (a training run would also mark
    its parameters for the sequence-parallel gradient reduction)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5) -> Any:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)
        plain.sequence_parallel = False
        return WrappedTorchNorm(plain, hidden_size, eps)


def sizing_spec(args: Any, layout: Layout) -> Any:
    """The layer spec the host builds (:func:`~megatron_adacc.models.attention.layer_spec`), with norms that accept
    sequence parallelism when the layout asks for it."""
    from megatron_adacc.models.attention import layer_spec

    spec = layer_spec(args)
    if not layout.sequence_parallel:
        return spec
    spec = copy.deepcopy(spec)
    spec.submodules.input_layernorm = _NormWithoutSequenceParallel
    spec.submodules.pre_mlp_layernorm = _NormWithoutSequenceParallel
    return spec


def sizing_config(config: Any, layout: Layout, target: str, masked_softmax_fusion: bool = True) -> Any:
    """``config`` as one rank of ``layout`` builds it, with ``target``'s softmax (module docstring), allocating
    nothing it initializes."""
    out = layout.shard(config)
    out.perform_initialization, out.use_cpu_initialization = False, True
    out.recompute_granularity = out.recompute_method = out.recompute_num_layers = None
    if target == "cuda" and masked_softmax_fusion and out.params_dtype in (torch.float16, torch.bfloat16):
        out.attention_softmax_in_fp32 = False
    return out


class FakeModel:
    """Layer 1 of the model as one rank of ``layout`` builds it, on fake tensors, and the inputs a micro-batch gives
    it. Build and use it inside one :func:`fake_tensors` block (its parameters belong to that mode)."""

    def __init__(self, args: Any, config: Any, layout: Layout, target: str = "cpu",
                 masked_softmax_fusion: bool = True) -> None:
        from megatron.core.tensor_parallel.random import _fork_rng
        from megatron.core.transformer.spec_utils import build_module

        layout.check(config, args.seq_length)
        self.args, self.layout, self.target = args, layout, target
        self.config = sizing_config(config, layout, target, masked_softmax_fusion)
        self.groups = fake_groups(layout)
        with _fork_rng():
            self.layer = build_module(sizing_spec(args, layout), config=self.config, layer_number=1,
                                      pg_collection=self.groups)
        self.layer.train()
        self._gpt: Any = None  # the whole one-layer model, built once for the ends' times

    def sample(self, micro_batch: int) -> LayerSample:
        """The layer with the inputs of a micro-batch of ``micro_batch`` sequences."""
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        cfg, s = self.config, self.args.seq_length
        tokens = s // self.layout.tensor if self.layout.sequence_parallel else s
        # requiring grad, as in training: a norm saves more when its input's gradient is wanted (RMSNorm's rstd)
        hidden = torch.empty(tokens, micro_batch, cfg.hidden_size, dtype=cfg.params_dtype, requires_grad=True)
        mask = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)[None, None]  # Megatron's causal mask
        # rotary embeddings are an input every layer shares: their values change no size
        rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)(s) \
            if self.args.position_embedding_type == "rope" else None
        return LayerSample(layer=self.layer, hidden=hidden, mask=mask, rope=rope)

    def sizes(self, micro_batch: int) -> tuple[Any, dict[str, set]]:
        """The runtime's per-op sizes (``LayerSizes``) for every codec each op offers, and those codecs: the
        profiler's own measurement (:func:`~megatron_adacc.adacc.integration.profiler.measure_sizes`), on fake
        tensors."""
        return measure_sizes(self.sample(micro_batch), codec_keys(self.args), lambda _line: None)

    def ends_seconds(self, micro_batch: int, gpu: GpuSpec, dtype: str) -> float:
        """The roofline time of the model's ends (embedding, final norm, output layer and loss) for one micro-batch,
        forward and backward: megatron's one-layer GPT run whole, less its layer run alone. Sequence parallelism
        changes none of their arithmetic (only their collectives, which a roofline leaves out), so the ends are
        built without it (megatron-core's local final norm refuses it)."""
        from megatron.core.tensor_parallel.random import _fork_rng

        from megatron_adacc.adacc.integration.model_states import one_layer_gpt

        s = self.args.seq_length
        if self._gpt is None:
            self._gpt = one_layer_gpt(self.args, self.config, self.groups)
            self._gpt.train()
        gpt = self._gpt
        tokens = torch.zeros(micro_batch, s, dtype=torch.long)
        positions = torch.arange(s).expand(micro_batch, s)
        mask = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)[None, None]
        hidden = torch.empty(s, micro_batch, self.config.hidden_size, dtype=self.config.params_dtype,
                             requires_grad=True)
        with _fork_rng(), torch.enable_grad():
            with Roofline(gpu, dtype) as whole:
                gpt(tokens, positions, mask, labels=tokens).sum().backward()
            rope = gpt.rotary_pos_emb(s) if getattr(gpt, "rotary_pos_emb", None) is not None else None
            with Roofline(gpu, dtype) as layer:
                out = gpt.decoder.layers[0](hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rope)[0]
                out.backward(torch.ones_like(out))
        return max(0.0, whole.seconds - layer.seconds)


@dataclass
class OpTimes:
    """Roofline seconds of one op of a layer."""

    forward_s: float
    backward_s: float


def op_times(sample: LayerSample, gpu: GpuSpec, dtype: str) -> dict[str, OpTimes]:
    """Each op's forward and backward on ``gpu``'s roofline: the forward as the layer runs it, the backward from
    leaf copies of its inputs (so it reaches no earlier op), as the profiler measures an op's backward."""
    from megatron.core.tensor_parallel.random import _fork_rng

    from megatron_adacc.adacc.runtime import layer_ops
    from megatron_adacc.adacc.runtime.ops import initial_env

    env = initial_env(sample.hidden.detach().requires_grad_(True), sample.mask, sample.rope)
    times: dict[str, OpTimes] = {}
    with _fork_rng(), torch.enable_grad():
        for op in layer_ops(sample.layer):
            with Roofline(gpu, dtype) as forward:
                outputs = op.run(env)
            env.update(outputs)
            outs, grads = _fresh_outputs(op, env)
            with Roofline(gpu, dtype) as backward:
                if outs:
                    torch.autograd.backward(outs, grads)
            sample.layer.zero_grad(set_to_none=True)
            times[op.name] = OpTimes(forward.seconds, backward.seconds)
    return times


def _fresh_outputs(op: Any, env: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``op`` run again from leaf copies of its inputs: the outputs to backpropagate through, and their gradients."""
    outs = [v for v in op.run(leaf_copies(op, env)).values() if isinstance(v, torch.Tensor) and v.requires_grad
            and not isinstance(v, torch.nn.Parameter)]
    return outs, [torch.ones_like(v) for v in outs]
