"""Run megatron-core's GPT, recompute, DDP and optimizer on a machine without a GPU.

megatron-core assumes CUDA in a handful of places (buffers on ``torch.cuda.current_device()``, ``device='cuda'``
literals, the CUDA RNG tracker behind dropout, CUDA streams in DDP). None of it is needed for the math, so on a
CPU-only machine we redirect exactly those places and nothing else:

* a ``torch`` proxy replaces the module-global ``torch`` in the listed megatron modules: tensor factories map a
  CUDA device to the CPU, ``torch.cuda.current_device()`` answers ``cpu``, and streams become no-ops;
* the RNG tracker keeps CPU generator states, so dropout inside ``get_cuda_rng_tracker().fork()`` is replayable
  by recompute exactly as on a GPU;
* two megatron helpers that assert CUDA tensor types get CPU twins.

The layer is used by our tests, the demo and CI. It refuses to activate when a CUDA device is present, because
there megatron must run untouched. ``apply()`` is idempotent.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types

import megatron.core
import torch

from megatron_adacc.compat.cuda_stand_ins import CPU, CudaPresentError, NullEvent, NullStream, to_cpu_device
from megatron_adacc.compat.versions import megatron_line
from megatron_adacc.core.patching import mark, patch

log = logging.getLogger(__name__)

#: Set on ``megatron.core`` once :func:`apply` has run. The layer is more than its function patches (each of
#: which carries :mod:`megatron_adacc.core.patching`'s marker): module globals are swapped for the proxy too.
_APPLIED_FLAG = "__megatron_adacc_cpu_patched__"

#: Modules whose global ``torch`` is swapped for the proxy. Missing modules (other releases) are skipped.
_PROXIED_MODULES = (
    "megatron.core.utils",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.schedules",
)


def _make_cuda_proxy() -> types.SimpleNamespace:
    real = torch.cuda
    proxy = types.SimpleNamespace()
    for name in dir(real):
        if not name.startswith("__"):
            setattr(proxy, name, getattr(real, name))
    proxy.current_device = lambda: CPU
    proxy.device_count = lambda: 0
    proxy.Stream = NullStream
    proxy.Event = NullEvent
    proxy.current_stream = lambda device=None: NullStream()
    proxy.default_stream = lambda device=None: NullStream()
    proxy.stream = lambda stream=None: contextlib.nullcontext()
    proxy.synchronize = lambda device=None: None
    proxy.empty_cache = lambda: None
    proxy.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None)
    return proxy


def _factory(fn):
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return mark(wrapper, fn)


class _TorchProxy(types.ModuleType):
    """``torch`` with CUDA devices mapped to the CPU. Everything else is the real module."""

    _FACTORIES = (
        "tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint",
        "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor",
    )

    def __init__(self):
        super().__init__("torch")
        self.cuda = _make_cuda_proxy()
        for name in self._FACTORIES:
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_PROXY = _TorchProxy()


def _patch_module_torch(module_name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    if getattr(module, "torch", None) is torch:
        module.torch = _TORCH_PROXY


def _patch_rng_tracker() -> None:
    """Keep the tracker's named states as CPU generator states.

    On a GPU, dropout draws from the CUDA generator and ``fork()`` swaps which state it holds; the CPU generator
    is left alone. On the CPU both are the same generator, so ``fork()`` swaps the CPU state itself, and the
    "CPU RNG state changed within GPU RNG context" check of the original would always fire.
    """
    # megatron-core's internals are imported here, once apply() has checked the release line.
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator(device="cpu").manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name

    why = "the CPU layer keeps the RNG tracker's states as CPU generator states"
    for owner, name, replacement in ((mrandom, "_get_cuda_rng_state", get_state),
                                     (mrandom, "_set_cuda_rng_state", set_state),
                                     (mrandom.CudaRNGStatesTracker, "add", add),
                                     (mrandom.CudaRNGStatesTracker, "fork", fork)):
        patch(owner, name, lambda _original, replacement=replacement: replacement, why)


def _patch_checkpoint_without_output() -> None:
    """``CheckpointWithoutOutput(fp8=False)`` sets ``self.fp8 = fp8 is not None`` (True), which takes a
    transformer-engine-only path. Without transformer-engine there is no FP8, so force it off."""
    from megatron.core.tensor_parallel import random as mrandom  # after apply()'s release-line check

    if getattr(mrandom, "HAVE_TE", False):
        return

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.fp8 = False

        return __init__

    patch(mrandom.CheckpointWithoutOutput, "__init__", make, "the CPU layer turns FP8 off without transformer-engine")


def _patch_clip_grads() -> None:
    """megatron's clip asserts ``grad.type() == 'torch.cuda.FloatTensor'``; the math is a plain scale."""
    from megatron.core.optimizer import clip_grads, optimizer  # after apply()'s release-line check

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for g in grads:
                g.copy_(g * clip_coeff)  # the same arithmetic as megatron's local multi_tensor_scale

    why = "the CPU layer clips gradients without megatron's CUDA type assertion"
    replacement = patch(clip_grads, "clip_grad_by_total_norm_fp32", lambda _original: clip_grad_by_total_norm_fp32,
                        why)
    # the optimizer module imported the function by name before we patched it
    patch(optimizer, "clip_grad_by_total_norm_fp32", lambda _original: replacement, why)


@contextlib.contextmanager
def _cuda_type_names():
    """Make ``tensor.type()`` of CPU tensors read ``torch.cuda.FloatTensor`` etc. while megatron's optimizer
    sorts parameters into fp32 / fp16 groups by comparing those strings. Scoped to the few constructors that
    do it, so nothing else ever sees the renamed types."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _patch_optimizer_type_checks() -> None:
    from megatron.core.optimizer import distrib_optimizer, optimizer  # after apply()'s release-line check

    def make(fn):
        def wrapper(*args, **kwargs):
            with _cuda_type_names():
                return fn(*args, **kwargs)

        return wrapper

    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        patch(cls, "__init__", make, "the CPU layer lets megatron's optimizer group CPU parameters by type")
    # A staticmethod/classmethod called from __init__ needs no wrapping: it runs inside the scope above.


def is_applied() -> bool:
    """Whether :func:`apply` has run in this process."""
    return bool(getattr(megatron.core, _APPLIED_FLAG, False))


def apply() -> None:
    """Install the CPU compatibility layer (idempotent).

    Raises:
        CudaPresentError: a CUDA device is visible; megatron-core must run unmodified there.
        UnsupportedMegatronVersion: the installed megatron-core is not a supported release line.
    """
    if torch.cuda.is_available():
        raise CudaPresentError(
            "a CUDA device is present, so megatron-adacc's CPU compatibility layer stays off: megatron-core "
            "runs unmodified on the GPU. Use --device cuda (or hide the GPUs with CUDA_VISIBLE_DEVICES='' "
            "to train on the CPU on purpose)."
        )
    if getattr(megatron.core, _APPLIED_FLAG, False):
        return
    line = megatron_line()
    for name in _PROXIED_MODULES:
        _patch_module_torch(name)
    _patch_rng_tracker()
    _patch_checkpoint_without_output()
    _patch_clip_grads()
    _patch_optimizer_type_checks()
    setattr(megatron.core, _APPLIED_FLAG, True)
    log.debug("megatron-core %d.%d CPU compatibility layer installed", *line)
