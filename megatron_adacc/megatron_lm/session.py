"""configure / attach: what the patched ``pretrain_gpt.py`` calls, and the training-loop hooks they need.

The patch calls :func:`configure` once, right after ``parse_and_validate_args``. With every megatron-adacc
flag at its "off" value it returns ``None`` having imported, installed and changed nothing, so the run is the
stock one. Otherwise it checks the flag combination and wraps four functions of
``megatron.training.training`` (each wrapper idempotent, with the original kept as ``__wrapped__``)
and, for ``--adama``, one of the model builder:

* ``setup_model_and_optimizer``: after Megatron built the model chunks, the optimizer and loaded a checkpoint,
  :func:`attach` sets up the extensions the enabled features built (the registry,
  :mod:`megatron_adacc.features`, iterated exactly as ``adacc train`` does);
* ``save_checkpoint``: writes the extensions' state beside Megatron's checkpoint, which the
  ``setup_model_and_optimizer`` wrapper reads back when Megatron loaded one
  (:mod:`megatron_adacc.megatron_lm.checkpoints`);
* ``train_step``: calls the extensions' ``on_step_begin`` / ``on_step_end`` and enters their
  ``microbatch_context`` around every micro-batch's forward (saved-tensor hooks registered there also govern
  that micro-batch's backward, because autograd keeps the unpack hook with each saved tensor);
* ``megatron.training.models.dist_utils._ddp_wrap`` and ``get_megatron_optimizer``, only when an enabled
  feature declares the ``wrap_model`` / ``build_optimizer`` hooks (AdamA): the extensions' hooks choose the
  model wrappers and the optimizer, before Megatron creates the learning-rate scheduler around it. The
  extensions are then built at the first of these hooks, when the model's config exists.

Wrapping these module globals instead of editing ``training.py`` keeps the upstream patch to one file:
``training.py`` is the most frequently changed file of Megatron-LM, while ``pretrain`` and ``train`` look
these names up in their modules at call time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from megatron_adacc.core import features as core_features
from megatron_adacc.core import log, patching
from megatron_adacc.core.errors import AdaccError, debug_asked, refusal_line
from megatron_adacc.core.extension import TrainingContext
from megatron_adacc.core.features import Feature, build_extensions
from megatron_adacc.megatron_lm.features import check_combination, enabled_features, idle_feature_flags

TRAINING_MODULE = "megatron.training.training"
#: Where the model builder wraps chunks in DDP (replaced under ``--adama``).
DIST_UTILS_MODULE = "megatron.training.models.dist_utils"
#: The ``training.py`` names we wrap, and for which features.
HOOKED_FUNCTIONS = ("setup_model_and_optimizer", "train_step", "get_megatron_optimizer", "save_checkpoint")

_SESSION: Session | None = None
#: Names the request file of a measuring child of this command (:mod:`megatron_adacc.megatron_lm.host`): set by
#: the parent for the child, which :func:`configure` reads before anything else.
MEASURE_ENV = "ADACC_MEASURE_RUN"


def current_session() -> Session | None:
    """The session :func:`configure` created for this process, or None (nothing enabled / not configured)."""
    return _SESSION


# -------------------------------------------------------------------------------------------- session


def _unwrap(chunk: Any) -> Any:
    """DDP / Float16Module / FSDP wrappers all keep the wrapped module as ``.module``."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _nonfinite() -> Any:
    from megatron_adacc.core.saved import NONFINITE  # torch: only once a feature is on

    return NONFINITE


def _settle_after_failure() -> None:
    """A step that raised (Megatron refusing a NaN loss or gradient, often one a NaN activation made): settle the
    features' values of the step first, so that the activations that held NaN/Inf are named, by layer and op,
    before the error ends the run. Its own failure must not hide the step's."""
    from megatron_adacc.core.step_end import STEP_END

    try:
        STEP_END.settle()
    except Exception:  # noqa: BLE001 - the step's exception is the one to report
        pass


def _loss_of(step_result: Any) -> float:
    """The reduced ``lm loss`` of a ``train_step`` result (NaN on ranks that have none: pipeline stages), read
    in one transfer with the features' values of the step (:data:`~megatron_adacc.core.step_end.STEP_END`: the
    saved activations' NaN/Inf flags, outlier counts), which are settled here: the step costs them no sync."""
    import torch  # only once a feature is on

    from megatron_adacc.core.step_end import STEP_END

    losses = step_result[0] if isinstance(step_result, tuple) and step_result else None
    value = losses.get("lm loss", next(iter(losses.values()))) if isinstance(losses, dict) and losses else math.nan
    extra = STEP_END.take()
    if not isinstance(value, torch.Tensor):
        STEP_END.settle()  # nothing of Megatron's to read along: one read of their own
        return float(value)
    if extra is None:
        return float(value.item())
    # float64 holds the loss and the counts exactly
    numbers = torch.cat([value.detach().reshape(1).double().to(extra.device), extra.double()]).tolist()
    STEP_END.settle(numbers[1:])
    return float(numbers[0])


class Session:
    """The enabled features of one run and the extensions they built."""

    def __init__(self, args: Any, features: list[Feature]):
        self.args = args
        self.features = features
        self.extensions: list[Any] = []
        self._built: list[Any] | None = None
        self.attached = False
        # (forward_step_func, data_iterator, model) of the running train_step, for the gradient probe.
        self._step: tuple | None = None
        self._probe_batch: tuple | None = None

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.features]

    def enabled(self, feature: Feature | str) -> bool:
        name = feature if isinstance(feature, str) else feature.name
        return name in self.names

    def needs(self, hook: str) -> bool:
        """Whether an enabled feature declares the optional host hook ``hook``."""
        return core_features.needs_hook(self.features, hook)

    def preflight(self) -> None:
        """Each enabled feature's early checks, so a missing module or file fails before Megatron starts."""
        for feature in self.features:
            feature.preflight(self.args)

    def build(self, config: Any) -> list[Any]:
        """The enabled features' extensions, built once, at the first hook that has the model's config."""
        if self._built is None:
            self._built = [e for e in build_extensions(self.features, self.args, config) if e is not None]
        return self._built

    # -- after model and optimizer exist
    def attach(self, model: list, optimizer: Any) -> list[Any]:
        """Set up every extension on the built model and optimizer; called once per run."""
        if self.attached:
            raise RuntimeError("megatron-adacc is already attached to a model in this process")
        model = list(model) if isinstance(model, (list, tuple)) else [model]
        unwrapped = [_unwrap(chunk) for chunk in model]
        config = getattr(unwrapped[0], "config", None)
        extensions = self.build(config)
        ctx = TrainingContext(args=self.args, config=config, model=unwrapped, ddp_model=model,
                              optimizer=optimizer, forward_backward=self.probe_forward_backward)
        for extension in extensions:
            extension.setup(ctx)
        self.extensions = extensions
        self.attached = True
        _print_rank0(f"enabled {', '.join(self.names)}; extensions: "
                     f"{', '.join(getattr(e, 'name', type(e).__name__) for e in extensions) or 'none'}")
        return extensions

    # -- GACT's gradient probe
    def probe_forward_backward(self) -> float:
        """``TrainingContext.forward_backward`` inside Megatron-LM: one forward and backward of a fixed batch.

        The batch is the next training micro-batch at the first probe, peeked: Megatron's ``RerunDataIterator``
        gets it back in front of its stream, so training sees the same data as without the probe. It is
        replayed on every later call (GACT's sensitivity estimate compares gradient evaluations that may differ
        only in a compressor's seed) and saved with checkpoints, so a resumed run probes the same batch. The
        backward runs under every chunk's ``no_sync()``: gradients stay local, as in ``adacc train``, and no
        bucket reduction starts. The loss is Megatron-LM's ``loss_func`` result per token.
        """
        if self._step is None:
            raise RuntimeError("the gradient probe can only run inside a training step (from on_step_begin)")
        forward_step_func, data_iterator, model = self._step
        if isinstance(data_iterator, list):
            raise RuntimeError("the gradient probe does not support virtual pipeline stages (a list of iterators)")
        if self._probe_batch is None:
            self._probe_batch = (_peek(data_iterator),)
        batch = self._probe_batch[0]
        with contextlib.ExitStack() as stack:
            stack.enter_context(_outside_rerun_bookkeeping())
            for chunk in model:
                if hasattr(chunk, "no_sync"):
                    stack.enter_context(chunk.no_sync())
            output, loss_func = forward_step_func(itertools.repeat(batch) if batch is not None else None,
                                                  model[0])
            result = loss_func(output)
            loss = result[0] / result[1].clamp(min=1) if len(result) == 3 else result[0]  # (sum, tokens, report)
            loss.backward()
        return float(loss.detach())

    # -- checkpoints
    def host_state(self) -> dict[str, Any]:
        """What this session itself carries across a checkpoint (the gradient probe's batch)."""
        return {"probe_batch": self._probe_batch[0]} if self._probe_batch is not None else {}

    def load_host_state(self, state: dict[str, Any]) -> None:
        if "probe_batch" in state:
            self._probe_batch = (state["probe_batch"],)

    # -- around every training step
    def on_step_begin(self, iteration: int) -> None:
        for extension in self.extensions:
            extension.on_step_begin(iteration)

    def on_step_end(self, iteration: int, loss: float) -> None:
        for extension in self.extensions:
            extension.on_step_end(iteration, loss)

    def microbatch_context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for extension in self.extensions:
            stack.enter_context(extension.microbatch_context())
        return stack

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        if not self.extensions:
            return forward_step_func

        # functools.wraps keeps the signature: Megatron's schedules inspect forward_step_func's parameters.
        @functools.wraps(forward_step_func)
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            with self.microbatch_context():
                return forward_step_func(*args, **kwargs)

        return forward_step

    def report(self) -> dict[str, Any]:
        return {getattr(e, "name", type(e).__name__): e.report() for e in self.extensions}


@contextlib.contextmanager
def _outside_rerun_bookkeeping():
    """Megatron's rerun state machine (default mode ``validate_results``) asserts that ``validate_result``, which
    ``pretrain_gpt.py``'s loss function calls, runs inside a training step's forward-backward pass. The probe's
    pass is not one of those: for its duration the machine is ``disabled``, in which mode ``validate_result``
    still refuses NaN/Inf losses but keeps no record of them."""
    try:
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
    except ImportError:  # a megatron-core without the machine
        yield
        return
    machine = get_rerun_state_machine()
    mode = machine.get_mode()
    machine.set_mode(RerunMode.DISABLED)
    try:
        yield
    finally:
        machine.set_mode(mode)


def _peek(data_iterator: Any) -> Any:
    """The next item of ``data_iterator``, left in front of its stream where the iterator allows it.

    Megatron-LM wraps its data iterators in a ``RerunDataIterator`` (which its rerun state machine requires by
    type), reading from ``.iterable``: that is where the item goes back. Any other iterator loses the item."""
    if data_iterator is None:
        return None
    source = getattr(data_iterator, "iterable", None)
    if source is None:
        return next(data_iterator)
    item = next(source)
    data_iterator.iterable = itertools.chain([item], source)
    return item


def _print_rank0(message: str) -> None:
    log.get_logger().info(message)  # the handler prints rank 0's lines only


# ------------------------------------------------------------------------------ training.py wrappers


_WHY = "megatron-adacc's Megatron-LM integration supports the commits listed in docs/megatron-lm.md"


def _patch_setup_model_and_optimizer(training: ModuleType) -> None:
    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            session = current_session()
            if session is not None and not session.attached:
                session.attach(result[0], result[1])
                # Megatron loaded its checkpoint above and set args.iteration; the features' state follows.
                iteration = int(getattr(session.args, "iteration", 0) or 0)
                if getattr(session.args, "load", None) and iteration > 0:
                    from megatron_adacc.megatron_lm import checkpoints  # torch: only once a feature runs

                    session.load_host_state(checkpoints.load(session.extensions, session.args.load, iteration,
                                                             log=_print_rank0))
            return result

        return setup_model_and_optimizer

    patching.patch(training, "setup_model_and_optimizer", make, _WHY)


def _patch_train_step(training: ModuleType) -> None:
    def make(original: Callable) -> Callable:
        signature = inspect.signature(original)
        if "iteration" not in signature.parameters or "forward_step_func" not in signature.parameters:
            raise RuntimeError(f"{training.__name__}.train_step{signature} has no forward_step_func / iteration "
                               "parameter; this Megatron-LM is not one megatron-adacc supports")

        @functools.wraps(original)
        def train_step(*args: Any, **kwargs: Any) -> Any:
            session = current_session()
            if session is None or not session.extensions:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            step = (bound.arguments.get("iteration") or 0) + 1  # Megatron passes the 0-based count of done steps
            forward_step_func = bound.arguments["forward_step_func"]
            session._step = (forward_step_func, bound.arguments.get("data_iterator"), bound.arguments.get("model"))
            try:
                bound.arguments["forward_step_func"] = session.wrap_forward_step(forward_step_func)
                _nonfinite().begin_step(step)
                session.on_step_begin(step)
                result = original(*bound.args, **bound.kwargs)
                session.on_step_end(step, _loss_of(result))
            except BaseException:
                _settle_after_failure()
                raise
            finally:
                session._step = None
            return result

        return train_step

    patching.patch(training, "train_step", make, _WHY)


def _patch_save_checkpoint(training: ModuleType) -> None:
    """After Megatron saved checkpoint ``iteration``, save the features' state beside it
    (:mod:`megatron_adacc.megatron_lm.checkpoints`). Non-persistent (local) checkpoints carry none."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
            result = original(iteration, *args, **kwargs)
            session = current_session()
            if session is not None and session.extensions and not kwargs.get("non_persistent_ckpt", False):
                from megatron_adacc.megatron_lm import checkpoints  # torch: only once a feature runs

                checkpoints.save(session.extensions, session.args.save, int(iteration), session.host_state())
            return result

        return save_checkpoint

    patching.patch(training, "save_checkpoint", make, _WHY)


def _patch_get_megatron_optimizer(training: ModuleType) -> None:
    """The extensions' ``build_optimizer`` hooks choose the optimizer (AdamA instead of Megatron's)."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def get_megatron_optimizer(config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
            session = current_session()
            if session is None or not session.needs("build_optimizer"):
                return original(config, model_chunks, *args, **kwargs)
            extensions = session.build(_unwrap(model_chunks[0]).config)
            return core_features.build_optimizer(
                extensions, model_chunks, lambda chunks: original(config, chunks, *args, **kwargs))

        return get_megatron_optimizer

    patching.patch(training, "get_megatron_optimizer", make, _WHY)


def _patch_ddp_wrap(dist_utils: ModuleType) -> None:
    """The extensions' ``wrap_model`` hooks choose the model chunks' wrappers (AdamA's buffer-less stand-ins
    instead of Megatron's DDP, whose gradient buffer AdamA exists to remove)."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def _ddp_wrap(model: list, data_parallel_random_init: bool, ddp_config: Any, *args: Any, **kwargs: Any):
            session = current_session()
            if session is None or not session.needs("wrap_model"):
                return original(model, data_parallel_random_init, ddp_config, *args, **kwargs)
            extensions = session.build(_unwrap(model[0]).config)
            return core_features.wrap_model(
                extensions, model,
                lambda chunks: original(chunks, data_parallel_random_init, ddp_config, *args, **kwargs),
                ddp_config)

        return _ddp_wrap

    patching.patch(dist_utils, "_ddp_wrap", make, _WHY)


def install_training_hooks(training: ModuleType, features: Iterable[Feature],
                           dist_utils: ModuleType | None = None) -> None:
    """Wrap the ``training.py`` functions the enabled ``features`` need (idempotent)."""
    features = list(features)
    _patch_setup_model_and_optimizer(training)
    _patch_train_step(training)
    _patch_save_checkpoint(training)
    if core_features.needs_hook(features, "build_optimizer"):
        _patch_get_megatron_optimizer(training)
    if core_features.needs_hook(features, "wrap_model"):
        _patch_ddp_wrap(dist_utils or importlib.import_module(DIST_UTILS_MODULE))


def uninstall_training_hooks(training: ModuleType, dist_utils: ModuleType | None = None) -> None:
    """Put back the original functions (tests; a second run in the same process)."""
    for name in HOOKED_FUNCTIONS:
        if hasattr(training, name):
            patching.unpatch(training, name)
    if dist_utils is not None and hasattr(dist_utils, "_ddp_wrap"):
        patching.unpatch(dist_utils, "_ddp_wrap")


# ----------------------------------------------------------------------------------------- public API


def _one_line_refusals() -> None:
    """Print an :class:`AdaccError` that reaches the top of ``pretrain_gpt.py`` as ``adacc``'s own boundary
    (:func:`megatron_adacc.core.errors.refusal_boundary`) does: one line (what is wrong and the flag to change)
    instead of a traceback through Megatron's frames, said once for all ranks
    (:func:`~megatron_adacc.core.errors.refusal_line`); ``ADACC_DEBUG=1`` keeps the traceback, on every rank
    (Megatron-LM's parser has no ``--debug`` of ours). Every other exception keeps the previous hook. Errors
    still propagate as exceptions, so callers and tests can catch them."""
    previous = sys.excepthook
    if getattr(previous, "__adacc_refusals__", False):
        return

    def excepthook(kind, value, traceback):
        if not isinstance(value, AdaccError) or debug_asked():
            previous(kind, value, traceback)
            return
        line = refusal_line(value, "megatron-adacc", _rank())
        if line is not None:
            print(line, file=sys.stderr, flush=True)

    excepthook.__adacc_refusals__ = True
    sys.excepthook = excepthook


def _rank() -> int:
    """This process's rank: torch.distributed's once Megatron initialized it (a refusal from a training-loop
    hook), else torchrun's ``RANK`` (the flag checks run before Megatron initializes anything)."""
    return log.rank()


def _install_logging(args: Any) -> None:
    """Our lines at Megatron-LM's level: ``--logging-level``, else ``$MEGATRON_LOGGING_LEVEL`` (Megatron-LM's own
    precedence), else ours (``$ADACC_LOG_LEVEL``, INFO)."""
    level = getattr(args, "logging_level", None)
    if level is None:
        level = os.environ.get("MEGATRON_LOGGING_LEVEL") or None
    log.install(level)


def configure(args: Any, *, training: ModuleType | None = None,
              dist_utils: ModuleType | None = None) -> Session | None:
    """Called by the patched ``pretrain_gpt.py`` right after ``parse_and_validate_args``.

    Returns None, having done nothing at all, when every megatron-adacc flag is off. Otherwise checks the flag
    combination against the rest of the command line, imports the entry points of the enabled features (so a
    missing one fails now) and wraps ``training.py``'s functions (see the module docstring). ``training`` is
    ``megatron.training.training`` and ``dist_utils`` ``megatron.training.models.dist_utils`` unless a test
    passes stand-ins. A flag that configures a feature left off (``--gact-bits 2`` without ``--gact-level``)
    is refused even when no feature is on: the stock run it would start is not the one its user asked for.
    """
    global _SESSION
    if os.environ.get(MEASURE_ENV):  # a measuring child of this command: the parent's changes come first
        from megatron_adacc.megatron_lm.host import apply_request

        apply_request(args)
    features = enabled_features(args)
    if not features:
        _SESSION = None
        if not idle_feature_flags(args):
            return None
    _one_line_refusals()
    _install_logging(args)
    check_combination(args, features)  # with no feature on, it raises for the idle flags
    session = Session(args, features)
    session.preflight()
    install_training_hooks(training or importlib.import_module(TRAINING_MODULE), features, dist_utils)
    from megatron_adacc.core import host
    from megatron_adacc.megatron_lm.host import MegatronLMHost

    host.install(MegatronLMHost())  # auto's CPU budget calibrates with short runs of this command
    _SESSION = session
    return session


def attach(model: Any, optimizer: Any, args: Any) -> list[Any]:
    """Set megatron-adacc up on built model chunks and optimizer; returns the active training extensions.

    The patched ``pretrain_gpt.py`` does not call this itself: the ``setup_model_and_optimizer`` wrapper
    installed by :func:`configure` does, at the one point where Megatron has both. Custom training scripts
    that build their own model can call it directly (after :func:`configure`, or alone).
    """
    global _SESSION
    session = _SESSION if _SESSION is not None and _SESSION.args is args else None
    if session is None:
        features = enabled_features(args)
        if not features:
            return []
        check_combination(args, features)
        session = Session(args, features)
        session.preflight()
        _SESSION = session
    return session.attach(model, optimizer)


def reset() -> None:
    """Forget the current session and the host it installed (tests)."""
    from megatron_adacc.core import host
    from megatron_adacc.megatron_lm.host import MegatronLMHost

    global _SESSION
    _SESSION = None
    host.uninstall(MegatronLMHost)
