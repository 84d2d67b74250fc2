"""Megatron-LM's training loop on a machine without a GPU: Megatron sees one CUDA device, and it is the CPU.

    python -m megatron_adacc.testing.megatron_lm_cpu SCRIPT [ARGS...]       # e.g. a checkout's pretrain_gpt.py
    torchrun --nproc_per_node 2 -m megatron_adacc.testing.megatron_lm_cpu SCRIPT [ARGS...]

Test support, for CI and for developers without a GPU; users on GPUs never load it, and :func:`install` refuses
to run where a CUDA device exists. Megatron-LM's ``megatron.training`` asserts CUDA, places buffers on
``torch.cuda.current_device()`` and keeps its dropout streams in the CUDA generator. We redirect exactly those
uses, and only where Megatron makes them:

* an import hook rebinds the module-global ``torch`` of every ``megatron.*`` module (and a checkout's
  ``gpt_builders`` / ``model_provider``) to a proxy whose ``torch.cuda`` is the CPU. torch itself, this package
  and user code keep the real ``torch``: on them, ``torch.cuda.is_available()`` stays False;
* ``ADACC_E2E_RECORD=PATH`` records each iteration's exact loss and gradient norm
  (:mod:`megatron_adacc.testing.records`), for a checkout's script as for ours;
* three methods that raise on a machine without a GPU are patched process-wide (so nothing that worked before
  changes): ``Tensor.cuda`` and ``Module.cuda`` return ``self``; ``Tensor.type()`` answers the CUDA type name,
  and only when the caller's file lies in a ``megatron/`` folder;
* because the CPU generator also plays the CUDA generator, a data loader iterator that Megatron creates leaves it
  where it was (on a GPU that draw never reaches the dropout streams).

:data:`REDIRECTIONS` lists each redirection with the Megatron call sites that need it (line numbers of Megatron-LM
``d98e8a64``, the pinned commit; the same sites exist in megatron-core 0.19.2's ``megatron.training``).
Megatron's own flags do the rest: ``--no-persist-layer-norm`` and ``--no-gradient-accumulation-fusion`` (both
needed wherever apex is absent, GPU images included) and ``--distributed-backend gloo``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import inspect
import logging
import os
import runpy
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_adacc.compat.cuda_stand_ins import CudaPresentError, NullEvent, NullStream, to_cpu_device
from megatron_adacc.core.patching import mark, patch
from megatron_adacc.testing.records import record_iterations, record_path


@dataclass(frozen=True)
class Redirection:
    """One thing Megatron asks of CUDA, and what the CPU answers."""

    key: str
    what: str
    needed_by: str
    why: str


REDIRECTIONS: tuple[Redirection, ...] = (
    Redirection("G1", "Tensor.cuda() returns the tensor", "pretrain_gpt.py:141 (get_batch)",
                "RuntimeError: Found no NVIDIA driver"),
    Redirection("G2", "Module.cuda() returns the module", "megatron/training/models/dist_utils.py:190",
                "RuntimeError: Found no NVIDIA driver"),
    Redirection("G3", "Tensor.type() answers 'torch.cuda.FloatTensor' (callers under megatron/ only)",
                "core/optimizer/clip_grads.py:174; optimizer.py:1009,1028; distrib_optimizer.py:401,466,758",
                "AssertionError on the gradient type in optimizer.step()"),
    Redirection("G4", "DataLoader.__iter__ called from megatron/ leaves the generator where it was",
                "training/training.py:4618,4620 (iter(dataloader), iter(cyclic_iter(dataloader)) after "
                "load_checkpoint)", "the iterator draws its workers' base seed from the CPU generator, which "
                "here also stands for the CUDA one: a resumed run's extra draw would shift every dropout mask "
                "after it (on a GPU, dropout draws from the CUDA generator and never sees it)"),
    Redirection("S1a", "torch.cuda.is_available() -> True", "training/initialize.py:72",
                "AssertionError: Megatron requires CUDA."),
    Redirection("S1b", "torch.cuda.device_count() -> 1", "initialize.py:277,365,456",
                "with 0 devices mpu.initialize_model_parallel is skipped and the RNG tracker is not seeded"),
    Redirection("S1c", "torch.cuda.current_device() -> 0, set_device() does nothing",
                "initialize.py:289; tensor_parallel/layers.py:308,1073,1119,1443,1489; "
                "param_and_grad_buffer.py:1193; timers.py:303; core/utils.py:749; common_utils.py:285,308; "
                "random.py:165; dist_utils.py:190", "raises without a driver"),
    Redirection("S1d", "torch.<function>(..., device=<CUDA>) -> the CPU",
                "initialize.py:531-570; training.py:1722,1728,3308,3628,5542; clip_grads.py:108,112,180; "
                "optimizer.py:315,1281; schedules.py:776; rerun_state_machine.py:268; layers.py:305,1070,1117,"
                "1440,1487; param_and_grad_buffer.py:1190; timers.py:302; core/utils.py:746,1380",
                "raises without a driver"),
    Redirection("S1e", "torch.cuda.synchronize() does nothing", "core/timers.py:152,165", "raises"),
    Redirection("S1f", "torch.cuda.Stream / Event / current_stream / default_stream / stream: null stream and context",
                "dist_utils.py:346,347,349,407; param_and_grad_buffer.py:638", "raises"),
    Redirection("S1g", "torch.cuda.get_rng_state / set_rng_state / random.* / default_generators: the CPU "
                "generator", "tensor_parallel/random.py:118,166,303,306; rerun_state_machine.py:979",
                "raises; the RNG tracker's fork() and recompute's RNG replay need it"),
    Redirection("S1h", "torch.cuda.manual_seed / manual_seed_all: the CPU generator", "random.py:305,502",
                "the real one is a lazy no-op without a GPU: the model-parallel dropout stream would be unseeded"),
    Redirection("S1i", "torch.cuda.get_device_properties / get_device_capability / get_device_name: an sm_80 "
                "device named after the CPU", "training/utils/common_utils.py:504 (get_device_arch_version, "
                "read by arguments.py:1414 when TP or CP > 1)", "raises without a driver"),
    Redirection("S2", "_lazy_call(cb) runs cb at once; _lazy_init does nothing",
                "random.py:14 (imported by name), used at random.py:174",
                "the real one queues cb until a GPU appears, so fork() would never switch the dropout stream"),
    Redirection("W1", "compile_helpers() is skipped when helpers_cpp imports and no Makefile exists",
                "training/initialize.py:178-183 -> core/datasets/utils.py:25",
                "megatron-core's wheel ships helpers_cpp*.so without the Makefile; make fails"),
)

#: Top-level modules of a Megatron-LM checkout that see the CUDA-as-CPU ``torch`` besides ``megatron.*``.
CHECKOUT_MODULES = ("gpt_builders", "model_provider")


def _is_megatron_module(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.") or name in CHECKOUT_MODULES


def _caller_in_megatron(depth: int = 2) -> bool:
    filename = sys._getframe(depth).f_code.co_filename
    return "megatron" in Path(filename).parts


# ------------------------------------------------------------------------------------------ torch proxy


def _lazy_call(callback, **kwargs):  # S2
    callback()


def _lazy_init():  # S2
    return None


# S1g, S1h: the "CUDA" generator is the CPU generator.
def _get_rng_state(device="cuda"):
    return torch.get_rng_state()


def _set_rng_state(new_state, device="cuda"):
    torch.set_rng_state(new_state)


def _manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _device_properties(device=None) -> types.SimpleNamespace:
    """The one "CUDA" device: compute capability 8.0 (Megatron picks no pre-Ampere or Blackwell-only path), the
    machine's memory and cores."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(name="CPU (megatron-adacc harness)", major=8, minor=0, total_memory=memory,
                                 multi_processor_count=os.cpu_count() or 1)


class _CudaAsCpu(types.ModuleType):
    """``torch.cuda`` as Megatron's modules see it: one device, the CPU. Anything not redirected is the real
    attribute (``memory_allocated`` and ``empty_cache`` already answer 0 / nothing without a GPU)."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.is_available = lambda: True  # S1a
        self.device_count = lambda: 1  # S1b
        self.current_device = lambda: 0  # S1c
        self.set_device = lambda device: None  # S1c
        self.synchronize = lambda device=None: None  # S1e
        self.Stream = NullStream  # S1f
        self.Event = NullEvent
        self.current_stream = lambda device=None: NullStream()
        self.default_stream = lambda device=None: NullStream()
        self.stream = lambda stream=None: contextlib.nullcontext()
        self.get_rng_state, self.set_rng_state = _get_rng_state, _set_rng_state  # S1g
        self.manual_seed = self.manual_seed_all = _manual_seed  # S1h
        self.get_device_properties = _device_properties  # S1i
        self.get_device_capability = lambda device=None: (_device_properties().major, _device_properties().minor)
        self.get_device_name = lambda device=None: _device_properties().name
        self.default_generators = (torch.default_generator,)
        self.random = types.SimpleNamespace(get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state,
                                            manual_seed=self.manual_seed, manual_seed_all=self.manual_seed_all)
        self._lazy_call = _lazy_call  # S2
        self._lazy_init = _lazy_init

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


def _device_to_cpu(fn: Callable) -> Callable:
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = to_cpu_device(kwargs["device"])  # S1d
        return fn(*args, **kwargs)

    return mark(call, fn)


class _TorchAsSeenByMegatron(types.ModuleType):
    """``torch`` with ``torch.cuda`` the CPU and every function's ``device=`` CUDA argument mapped to the CPU.
    Classes (``torch.device``, ``torch.Tensor``), modules and constants are the real ones."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaAsCpu()

    def __getattr__(self, name: str):
        value = getattr(torch, name)
        if callable(value) and not isinstance(value, (type, types.ModuleType)):
            value = _device_to_cpu(value)
        setattr(self, name, value)  # resolved once per name
        return value


TORCH_AS_SEEN_BY_MEGATRON = _TorchAsSeenByMegatron()


# ------------------------------------------------------------------------------- module rebinding


def _skip_compile_helpers_for_wheel(original: Callable) -> Callable:
    """W1: the wheel's prebuilt ``helpers_cpp`` is enough; only a checkout has the Makefile to rebuild it."""
    def compile_helpers(*args, **kwargs):
        makefile = Path(inspect.getfile(original)).with_name("Makefile")
        if not makefile.exists() and importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            return None
        return original(*args, **kwargs)

    return mark(compile_helpers, original)


def _rebind(module: types.ModuleType) -> None:
    """Point one Megatron module's globals at the CPU stand-ins (idempotent)."""
    names = vars(module)
    if names.get("torch") is torch:
        module.torch = TORCH_AS_SEEN_BY_MEGATRON
    if names.get("_lazy_call") is getattr(torch.cuda, "_lazy_call", None):
        module._lazy_call = _lazy_call
    if names.get("_lazy_init") is getattr(torch.cuda, "_lazy_init", None):
        module._lazy_init = _lazy_init
    helper = names.get("compile_helpers")
    if callable(helper) and not hasattr(helper, "__wrapped__"):
        module.compile_helpers = _skip_compile_helpers_for_wheel(helper)


class _RebindingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _rebind(module)
        if module.__name__ == "megatron.training.training" and (records := record_path()):
            record_iterations(module, records)

    def __getattr__(self, name):  # get_resource_reader, is_package, ... of the real loader
        return getattr(self._loader, name)


class _MegatronImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the rest of ``sys.meta_path`` find a Megatron module, then rebinds it once it
    has executed."""

    def find_spec(self, name, path, target=None):
        if not _is_megatron_module(name):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RebindingLoader(spec.loader)
                return spec
        return None


# ------------------------------------------------------------------------------- global methods


def _patch_global_methods() -> None:
    why = "megatron-adacc's Megatron-LM CPU harness: one CUDA device that is the CPU"

    def tensor_cuda(original):  # G1
        def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
            return self

        return cuda

    def module_cuda(original):  # G2
        def cuda(self, device=None):
            return self

        return cuda

    def tensor_type(original):  # G3
        def type_(self, dtype=None, non_blocking=False, **kwargs):
            if dtype is None and not kwargs and self.device.type == "cpu" and _caller_in_megatron():
                return original(self).replace("torch.", "torch.cuda.", 1)
            return original(self, dtype, non_blocking, **kwargs)

        return type_

    def dataloader_iter(original):  # G4
        def __iter__(self):
            if not _caller_in_megatron():
                return original(self)
            state = torch.get_rng_state()
            try:
                return original(self)
            finally:
                torch.set_rng_state(state)

        return __iter__

    patch(torch.utils.data.DataLoader, "__iter__", dataloader_iter, why)
    patch(torch.Tensor, "cuda", tensor_cuda, why)
    patch(torch.nn.Module, "cuda", module_cuda, why)
    patch(torch.Tensor, "type", tensor_type, why)


# ------------------------------------------------------------------------------------------ public API


class _SameGeneratorNotice(logging.Filter):
    """Megatron's RNG tracker warns when the CPU generator moved inside ``fork()``. Here the "CUDA" generator
    is the CPU generator, so it moves on every fork: the notice says nothing about this run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def is_installed() -> bool:
    return any(isinstance(finder, _MegatronImportHook) for finder in sys.meta_path)


def install() -> None:
    """Make Megatron see one CUDA device that is the CPU (idempotent).

    Raises:
        CudaPresentError: a CUDA device is visible: Megatron-LM must run unmodified there.
    """
    if torch.cuda.is_available():
        raise CudaPresentError(
            "a CUDA device is present, so megatron-adacc's Megatron-LM CPU harness stays off: run "
            "pretrain_gpt.py directly (or hide the GPUs with CUDA_VISIBLE_DEVICES='' to test on the CPU)")
    if is_installed():
        return
    if not hasattr(typing, "override"):  # Python 3.11: megatron/training/models/gpt.py imports typing.override
        import typing_extensions

        typing.override = typing_extensions.override
    _patch_global_methods()
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_SameGeneratorNotice())
    sys.meta_path.insert(0, _MegatronImportHook())
    for name, module in list(sys.modules.items()):  # Megatron modules imported before install()
        if _is_megatron_module(name) and isinstance(module, types.ModuleType):
            _rebind(module)


def run_script(script: str, argv: list[str]) -> None:
    """Run ``script`` as ``__main__`` (as ``python SCRIPT ARGS`` would) with the harness installed."""
    path = Path(script).resolve()
    if not path.is_file():
        raise SystemExit(f"megatron_lm_cpu: no such script: {script}")
    install()
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent))  # a checkout's pretrain_gpt.py imports gpt_builders, model_provider
    runpy.run_path(str(path), run_name="__main__")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    run_script(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
