"""`adacc train`: train a megatron-core GPT on a text corpus (``--corpus``) with Megatron's DDP and optimizer.

The loop is Megatron-LM's ``train_step`` without pipeline parallelism: zero the grad buffer, run the
micro-batches (all but the last under ``no_sync``), finish the gradient reduction, step the optimizer.
Features join through :mod:`megatron_adacc.core.extension`.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from megatron_adacc import features
from megatron_adacc.core import features as core_features
from megatron_adacc.core import host as core_host
from megatron_adacc.core.devices import peak_memory_bytes, reset_peak_memory
from megatron_adacc.core.errors import AdaccError, IntegrationError
from megatron_adacc.core.extension import TrainingContext
from megatron_adacc.core.log import echo, get_logger, progress
from megatron_adacc.core.saved import NONFINITE, SavedTensorMeter
from megatron_adacc.core.step_end import STEP_END
from megatron_adacc.core.units import format_bytes
from megatron_adacc.training import checkpoint, distributed
from megatron_adacc.training import model as model_lib
from megatron_adacc.training.args import MAX_CONSECUTIVE_SKIPS
from megatron_adacc.training.data import BatchSampler, sampler_for
from megatron_adacc.training.host import TrainHost


def num_microbatches(args: SimpleNamespace, world: int) -> int:
    per_step = args.micro_batch_size * world
    if args.global_batch_size % per_step:
        raise IntegrationError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {world}."
        )
    return args.global_batch_size // per_step


def _forward_loss(model, batch) -> torch.Tensor:
    per_token = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
    return per_token.float().mean()


def _progress(iterable, enabled: bool, total: int):
    # rank 0 without --no-progress; core.log.progress adds a terminal and no -q
    return progress(iterable, total=total, desc="train", leave=True) if enabled else iterable


@dataclass
class _Run:
    """What one `adacc train` run is made of, once set up."""

    args: SimpleNamespace
    device: torch.device
    rank: int
    world: int
    n_micro: int
    extensions: list
    model: torch.nn.Module
    ddp: torch.nn.Module
    optimizer: Any
    sampler: BatchSampler
    params: list[torch.Tensor]
    """The model's parameters, which the saved-tensor meter of every micro-batch leaves out."""


def _set_up(args: SimpleNamespace) -> _Run:
    """Check the command line, then build the extensions, the model, its wrapper and optimizer (through the
    extensions' hooks), and set the extensions up. The order is fixed: it decides the random streams."""
    enabled = features.enabled(args)
    core_features.check(enabled, args)
    for feature in enabled:
        feature.preflight(args)
    model_lib.check_supported(args)
    device = distributed.resolve_device(args.device)
    rank, world = distributed.initialize(device, args.seed, _timeout(args))
    n_micro = num_microbatches(args, world)
    config = model_lib.transformer_config(args, device)
    extensions = core_features.build_extensions(enabled, args, config)

    model = model_lib.build_gpt(args, config).to(device)
    ddp = core_features.wrap_model(extensions, [model], lambda chunks: [model_lib.wrap_ddp(args, config, c)
                                                                         for c in chunks])[0]
    optimizer = core_features.build_optimizer(extensions, [ddp],
                                              lambda chunks: model_lib.build_optimizer(args, chunks[0]))
    sampler = sampler_for(args, rank=rank)
    run = _Run(args, device, rank, world, n_micro, extensions, model, ddp, optimizer, sampler,
               list(model.parameters()))
    ctx = TrainingContext(args=args, config=config, model=[model], ddp_model=[ddp], optimizer=optimizer,
                          forward_backward=_gradient_probe(run))
    for ext in extensions:
        ext.setup(ctx)
    return run


def _gradient_probe(run: _Run) -> Callable[[], float]:
    """``TrainingContext.forward_backward``: one forward and backward of a fixed held-out batch.

    One batch, replayed: GACT's sensitivity probe (Algorithm 1) compares gradient evaluations that must differ
    only in one compressor's seed."""
    args = run.args
    batches = sampler_for(args, split="valid", rank=run.rank)
    held_out = []

    def forward_backward() -> float:
        if not held_out:
            held_out.append(next(batches).to(run.device))
        loss = _forward_loss(run.ddp, held_out[0])
        loss.backward()
        return loss.item()

    return forward_backward


def _train_step(run: _Run, iteration: int, saved_bytes: list[int], interrupted: bool = False
                ) -> tuple[float, bool, bool]:
    """One optimizer step over ``n_micro`` micro-batches; returns the mean loss, whether the step ran, and
    whether any rank was interrupted (``interrupted`` here): the run ends after this step.
    Appends the bytes the first micro-batch saved for backward to ``saved_bytes``."""
    args, ddp, optimizer, n_micro = run.args, run.ddp, run.optimizer, run.n_micro
    NONFINITE.begin_step(iteration)
    for ext in run.extensions:
        ext.on_step_begin(iteration)
    for group in optimizer.param_groups:
        group["lr"] = model_lib.lr_at(args, iteration)
    if hasattr(ddp, "zero_grad_buffer"):
        ddp.zero_grad_buffer()
    optimizer.zero_grad()
    step_loss = torch.zeros((), device=run.device)
    for micro in range(n_micro):
        batch = next(run.sampler).to(run.device)
        sync = ddp.no_sync() if micro < n_micro - 1 and hasattr(ddp, "no_sync") else contextlib.nullcontext()
        with sync, contextlib.ExitStack() as stack:
            meter = stack.enter_context(SavedTensorMeter(run.params))
            for ext in run.extensions:
                stack.enter_context(ext.microbatch_context())
            loss = _forward_loss(ddp, batch)
            if micro == 0:
                saved_bytes.append(meter.nbytes)
            (loss / n_micro).backward()
        step_loss += loss.detach() / n_micro
    if hasattr(ddp, "finish_grad_sync"):
        ddp.finish_grad_sync()
    finite, stop = _step_flags(run, step_loss, interrupted)
    if not finite:
        return _refuse_nonfinite(run, iteration, step_loss), False, stop
    ok, _, _ = optimizer.step()
    if run.world > 1:
        torch.distributed.all_reduce(step_loss)
        step_loss /= run.world
    if run.device.type == "cuda":
        torch.cuda.synchronize()
    return step_loss.item(), ok, stop


class NonFiniteError(AdaccError, RuntimeError):
    """A training step produced NaN/Inf and the run cannot (or was told not to) go on."""


def _step_flags(run: _Run, step_loss: torch.Tensor, interrupted: bool) -> tuple[bool, bool]:
    """Whether this step's loss, every gradient and every saved activation are finite on every rank, and whether
    any rank was interrupted: one reduction and one host sync per step for all of it (every rank must skip, or
    stop, at the same step, or the others would wait in a collective). The features' values of the step
    (:data:`~megatron_adacc.core.step_end.STEP_END`: NaN/Inf flags of saved activations, outlier counts) come
    over in the same read, so they cost the step no sync of their own."""
    flags = [torch.isfinite(step_loss).all()]
    for p in run.params:
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        if grad is not None:
            flags.append(torch.isfinite(grad).all())
    # AdamA has no gradients left to check: its moments are, and its step then reads nothing itself.
    states_finite = getattr(run.optimizer, "states_finite", None)
    for flag in (NONFINITE.clean(), states_finite() if states_finite is not None else None):
        if flag is not None:
            flags.append(flag)
    both = torch.stack([torch.stack(flags).all(), torch.full((), not interrupted, device=step_loss.device)])
    both = both.to(torch.int64)
    if run.world > 1:
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN)
    extra = STEP_END.take()
    values = (both if extra is None else torch.cat([both, extra.to(both.device)])).tolist()
    STEP_END.settle(values[2:])
    finite, carry_on = values[:2]
    return bool(finite), not carry_on


def _refuse_nonfinite(run: _Run, iteration: int, step_loss: torch.Tensor) -> float:
    """``--on-nonfinite``: skip the step (weights and optimizer state untouched) or stop the run."""
    if getattr(run.optimizer, "folds_gradients", False):
        raise NonFiniteError(f"iteration {iteration}: NaN/Inf in the loss or gradients, which AdamA has already "
                             "folded into its moments; resume from the last checkpoint (--load), with a lower "
                             "--lr or --adama-clip-grad-per-tensor")
    if getattr(run.args, "on_nonfinite", "skip") == "stop":
        raise NonFiniteError(f"iteration {iteration}: NaN/Inf in the loss or gradients (--on-nonfinite stop); "
                             "nothing was saved from this step. Resume from the last checkpoint (--load)")
    if hasattr(run.ddp, "zero_grad_buffer"):
        run.ddp.zero_grad_buffer()
    run.optimizer.zero_grad()
    return float(step_loss)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during ``adacc train``: the step under way finished, and was saved with ``--save``."""


@contextlib.contextmanager
def _interruptible():
    """While training, SIGINT only sets a flag that the loop reads between steps: a step is never cut in half
    (which would leave gradients, collectives or a checkpoint half done). A second Ctrl-C interrupts at once."""
    import signal
    import threading

    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def on_sigint(signum, frame):
        if requested.is_set():
            raise KeyboardInterrupt
        requested.set()
        print("\n[adacc] interrupted: finishing the current step (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield requested
    finally:
        signal.signal(signal.SIGINT, previous)


def _loop(run: _Run, bar, interrupt, losses: list[float], step_times: list[float],
          saved_bytes: list[int]) -> int | None:
    """The training iterations of :func:`train`; a Ctrl-C ends them after the step under way. Returns the
    iteration last saved, so that no checkpoint is written twice."""
    args, extensions, is_main = run.args, run.extensions, run.rank == 0
    show_progress = is_main and not args.no_progress
    skipped_in_a_row, saved_at = 0, None
    for iteration in bar:
        t0 = time.perf_counter()
        loss_value, ok, stop = _train_step(run, iteration, saved_bytes, interrupt.is_set())
        dt = time.perf_counter() - t0
        losses.append(loss_value)
        step_times.append(dt)
        for ext in extensions:
            ext.on_step_end(iteration, loss_value)
        if show_progress:
            bar.set_postfix(loss=f"{loss_value:.3f}", step=f"{dt * 1e3:.0f}ms",
                            tok_s=f"{args.global_batch_size * args.seq_length / dt:,.0f}")
        skipped_in_a_row = 0 if ok else skipped_in_a_row + 1
        if not ok:
            get_logger().warning(f"iteration {iteration}: step skipped, loss {loss_value}: NaN/Inf in the loss or "
                                 "gradients (the weights are unchanged)")
        if skipped_in_a_row >= MAX_CONSECUTIVE_SKIPS:
            raise NonFiniteError(f"{skipped_in_a_row} steps in a row had NaN/Inf (iterations "
                                 f"{iteration - skipped_in_a_row + 1}-{iteration}); the data or the model is "
                                 "broken. Resume from the last checkpoint (--load), with a lower --lr")
        if args.save and (stop or (args.save_interval and iteration % args.save_interval == 0)):
            _save_checkpoint(args.save, run, iteration)
            saved_at = iteration
        if stop:
            where = f"; saved, resume with --load {args.save}" if args.save else ""
            raise TrainingInterrupted(f"interrupted after iteration {iteration}{where}")
    return saved_at


def _timeout(args: SimpleNamespace):
    return distributed.timeout_of(getattr(args, "distributed_timeout_minutes", None))


def train(args: SimpleNamespace, return_model: bool = False):
    """Run the training job described by ``args`` and return its summary (also written to --output-json).

    With ``return_model`` the result is ``(summary, model)``, for tests that inspect the trained weights.
    A rank that stops answering ends it with :class:`~megatron_adacc.training.distributed.RankTimeout`.
    """
    with distributed.naming_frozen_ranks(_timeout(args)):
        return _train(args, return_model)


def _train(args: SimpleNamespace, return_model: bool):
    NONFINITE.reset()
    STEP_END.discard()
    with core_host.running(TrainHost()):
        run = _set_up(args)
    model, extensions = run.model, run.extensions
    start_iter = _load_checkpoint(args.load, run) if args.load else 0

    is_main = run.rank == 0
    show_progress = is_main and not args.no_progress
    losses, step_times, saved_bytes = [], [], []
    reset_peak_memory(run.device)
    bar = _progress(range(start_iter + 1, args.train_iters + 1), show_progress, args.train_iters - start_iter)
    with _interruptible() as interrupt:
        saved_at = _loop(run, bar, interrupt, losses, step_times, saved_bytes)
    if args.save and saved_at != args.train_iters:
        _save_checkpoint(args.save, run, args.train_iters)

    summary = _summary(args, run.device, run.world, run.n_micro, losses, step_times, saved_bytes, extensions)
    if args.eval_iters:
        summary["valid_loss"] = evaluate(run.ddp, args, run.device, run.rank, run.world)
    if is_main:
        _print_summary(summary)
        if args.output_json:
            Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output_json).write_text(json.dumps(summary, indent=2))
    return (summary, model) if return_model else summary


@torch.no_grad()
def evaluate(model, args: SimpleNamespace, device: torch.device, rank: int, world: int) -> float:
    """Mean loss over ``--eval-iters`` held-out batches with dropout off (the same batches for every run)."""
    sampler = sampler_for(args, split="valid", rank=rank, seed=0)
    model.eval()
    try:
        total = torch.zeros((), device=device)
        for _ in range(args.eval_iters):
            total += _forward_loss(model, next(sampler).to(device))
        if world > 1:
            torch.distributed.all_reduce(total)
        return (total / (args.eval_iters * world)).item()
    finally:
        model.train()


def _summary(args, device, world, n_micro, losses, step_times, saved_bytes, extensions) -> dict:
    timed = step_times[1:] or step_times  # the first step pays for warm-up
    median = statistics.median(timed) if timed else float("nan")
    ext_reports = {ext.name: ext.report() for ext in extensions}
    saved = max(saved_bytes) if saved_bytes else 0
    for report in ext_reports.values():
        saved = report.get("saved_activation_bytes", saved)
    return {
        "device": str(device),
        "world_size": world,
        "num_microbatches": n_micro,
        "iterations": len(losses),
        "losses": losses,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "step_times_s": step_times,
        "step_time_s": median,
        "tokens_per_s": args.global_batch_size * args.seq_length / median if timed else None,
        "peak_memory_bytes": peak_memory_bytes(device),
        "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "peak_rss",
        "saved_activation_bytes": saved,
        "nonfinite_activations": NONFINITE.total,
        "extensions": ext_reports,
    }


#: Longest extension figure the printed summary shows in full (the summary fits 100 columns).
_SUMMARY_WIDTH = 70


def _print_summary(s: dict) -> None:
    peak_label = "peak allocated (CUDA)" if s["peak_memory_kind"] == "cuda_max_allocated" else "peak RSS"
    lines = [
        "",
        f"trained {s['iterations']} iterations on {s['device']} (data-parallel size {s['world_size']}, "
        f"{s['num_microbatches']} micro-batch(es) per step)",
        f"  loss            {s['first_loss']:.4f} -> {s['final_loss']:.4f}" if s["iterations"] else "",
        f"  step time       {s['step_time_s'] * 1e3:.1f} ms (median)",
        f"  throughput      {s['tokens_per_s']:,.0f} tokens/s" if s["tokens_per_s"] else "",
        f"  {peak_label:<15} {format_bytes(s['peak_memory_bytes'])}",
        f"  validation loss {s['valid_loss']:.4f}" if s.get("valid_loss") is not None else "",
        f"  held for backward by saved activations (first micro-batch): "
        f"{format_bytes(s['saved_activation_bytes'])}",
        f"  saved activations that held NaN/Inf: {s['nonfinite_activations']}"
        if s.get("nonfinite_activations") else "",
    ]
    width = max((len(key) for report in s["extensions"].values() for key in report), default=0) + 2
    for name, report in s["extensions"].items():
        lines.append(f"  {name}")
        lines += [f"    {key.replace('_', ' '):<{width}}{_readable(key, value)}" for key, value in report.items()]
    echo("\n".join(line for line in lines if line))


def _readable(key: str, value: Any) -> str:
    """An extension's figure on one short line: sizes in bytes units, counts as ``keep 40, recompute 12``, and
    for per-layer or per-iteration detail its length, the whole being in ``--output-json``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return format_bytes(value) if "bytes" in key else f"{value:.4g}" if isinstance(value, float) else str(value)
    flat = isinstance(value, (list, dict)) and all(
        v is None or isinstance(v, (str, int, float)) for v in (value.values() if isinstance(value, dict) else value))
    if isinstance(value, dict) and flat:
        shown = ", ".join(f"{k} {_readable(key, v)}" for k, v in value.items()) or "none"
    elif isinstance(value, list) and flat:
        shown = ", ".join(_readable(key, v) for v in value) or "none"
    elif isinstance(value, (list, dict)):
        return f"{len(value)} entries, in --output-json" if value else "none"
    else:
        shown = str(value)
    return shown if len(shown) <= _SUMMARY_WIDTH else shown[:_SUMMARY_WIDTH - 28] + " ... (all in --output-json)"


def _save_checkpoint(directory, run, iteration) -> None:
    state = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "sampler_rng": run.sampler.generator.get_state(), "rng": checkpoint.rng_states(run.device),
             "extensions": {ext.name: ext.state_dict() for ext in run.extensions}}
    checkpoint.save(directory, run.rank, iteration, state,
                    checkpoint.identity(run.model, run.optimizer, run.extensions))


def _load_checkpoint(directory, run) -> int:
    state = checkpoint.load(directory, run.rank, checkpoint.identity(run.model, run.optimizer, run.extensions))
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.sampler.generator.set_state(state["sampler_rng"])
    checkpoint.set_rng_states(state["rng"], run.device)
    for ext in run.extensions:
        if ext.name in state["extensions"]:
            ext.load_state_dict(state["extensions"][ext.name])
    return int(state["iteration"])
