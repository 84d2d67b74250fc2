"""``--adacc-policy auto``: profile if the database has no profile for this device and model, solve, train."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from megatron_adacc.adacc.integration import profile_child
from megatron_adacc.adacc.integration.model_states import charge_static, stage_layout
from megatron_adacc.adacc.integration.planning import isolated_solves, run_device
from megatron_adacc.adacc.policy.ops import Action
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.adacc.policy.profile import LayerProfile
from megatron_adacc.adacc.policy.profile_db import ProfileDB
from megatron_adacc.adacc.policy.signature import model_signature
from megatron_adacc.adacc.policy.solver import SolveOptions, op_costs, solve_stage
from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError
from megatron_adacc.adacc.runtime import stages
from megatron_adacc.compat.process import forked
from megatron_adacc.core.devices import resident_bytes
from megatron_adacc.core.errors import AdaccError
from megatron_adacc.core.log import get_logger
from megatron_adacc.core.units import format_bytes

T = TypeVar("T")


LOG = get_logger()
_log = LOG.info


def get_or_make_profile(args: Any, config: Any, *, log: Callable[[str], None] = _log, force: bool = False,
                        isolate: bool = False) -> tuple[LayerProfile, dict[str, Any]]:
    """The stored profile for this device and model signature, profiling (and storing) it when missing, with the
    static memory and logits workspace of this run (:func:`~.model_states.charge_static`: its vocabulary,
    parallel layout and optimizer).

    Profiling builds a one-layer model (:func:`~megatron_adacc.adacc.integration.sample.layer_sample`), which
    draws from the RNG as the real model's construction does. With ``isolate`` that happens in a child process
    (:mod:`~megatron_adacc.adacc.integration.profile_child`), so this process's peak memory and random streams
    are what they would be with a warm cache; under torch.distributed, rank 0 profiles and the others then read
    the database.
    """
    profile, ref = _stored_or_new_profile(args, config, log, force, isolate)
    return charge_static(profile, args, config), ref


def _stored_or_new_profile(args: Any, config: Any, log: Callable[[str], None], force: bool,
                           isolate: bool) -> tuple[LayerProfile, dict[str, Any]]:
    from megatron_adacc.adacc.integration.profiler import device_name

    device = run_device(args)
    db = ProfileDB(getattr(args, "adacc_profile_db", None))
    sig = model_signature(config, args)
    found = None if force else db.get(device_name(device), sig)
    if found is None and isolate:
        on_rank0(lambda: _profile_isolated(args, config, device, db, log))
        found = db.get(device_name(device), sig)  # None where ranks do not share the database: profile here
    if found is not None:
        pid, profile = found
        log(f"reusing profile #{pid} from {db.path} ({profile.device})")
        if profile.meta.get("contended"):  # said at every reuse: the policy rests on these timings
            LOG.warning(f"profile #{pid} was measured under contention ({profile.meta['contended']}); its times may "
                        "mislead the solver: `adacc profile --refresh` with the same flags on a quiet machine")
        return profile, db.reference(pid, profile)
    return profile_child.profile_and_store(args, config, device, db, log)


def _profile_isolated(args: Any, config: Any, device: torch.device, db: ProfileDB,
                      log: Callable[[str], None]) -> None:
    """Profile in a child process into ``db``; in this process when the arguments cannot be handed over."""
    data = profile_child.payload(args, config)
    if data is None:
        log("profiling in this process: its arguments cannot be handed to a child process (its peak memory "
            "then counts against the budget of this run)")
        profile_child.profile_and_store(args, config, device, db, log)
        return
    log("profiling in a child process (its memory and random numbers stay out of this run)")
    profile_child.profile_in_child(data, log)


class RankZeroRefusal(AdaccError):
    """Rank 0 failed at work done for every rank (its message says why); the other ranks stop with its words."""


def on_rank0(work: Callable[[], T]) -> T:
    """``work()`` on rank 0 only; its result, or its failure's words, reaches every rank (one broadcast).

    Used for what one rank should do for all: profile (the others then read the database), calibrate, solve
    (ranks whose timings differ would solve different policies, and a data-parallel group must run one).
    A failure on rank 0 stops the other ranks too, instead of leaving them waiting in the broadcast.
    """
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_world_size() == 1:
        return work()
    box: list[Any] = [None]
    failure: Exception | None = None
    if torch.distributed.get_rank() == 0:
        try:
            box[0] = ("done", work())
        except Exception as exc:
            failure, box[0] = exc, ("failed", str(exc) if isinstance(exc, AdaccError) else
                                    f"rank 0 failed: {type(exc).__name__}: {exc}")
    torch.distributed.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    kind, payload = box[0]
    if kind == "failed":
        raise RankZeroRefusal(payload)
    return payload


def make_policy(args: Any, config: Any, *, log: Callable[[str], None] = _log, isolate: bool = False) -> Policy:
    """Profile if needed, then solve the MILP under ``--adacc-memory-budget`` (default: the device's memory), each
    pipeline stage for its own layers (:func:`solve_stages`).

    Raises :class:`~megatron_adacc.adacc.policy.strategies.InfeasibleBudgetError` before training when no policy
    fits, naming the smallest feasible budget.
    """
    from megatron_adacc.adacc.integration.profiler import device_memory_bytes

    device = run_device(args)
    resident = resident_bytes()  # before profiling, which may run in this process
    layer, ref = _stored_or_new_profile(args, config, log, False, isolate)
    profile = charge_static(layer, args, config)
    if getattr(args, CALIBRATION_RUN, False) == COMPRESSING:
        return Policy.uniform("compress", config.num_layers)  # its process as auto's, its policy compressing
    if (device.type == "cpu" and not getattr(args, "adacc_process_baseline_bytes", None)
            and not getattr(args, CALIBRATION_RUN, False)):
        # Kept on args so that policy evolution re-solves against the same process memory.
        args.adacc_process_baseline_bytes = process_baseline(args, profile, ref, resident, log)
        args.adacc_codec_pages_bytes = codec_pages(args, ref)
    options = SolveOptions.from_args(args)
    budget = getattr(args, "adacc_memory_budget", None) or device_memory_bytes(device)
    return on_rank0(lambda: solve_stages(layer, ref, args, config, budget, options, log,
                                         isolate=isolated_solves(device)))


def solve_stages(layer: LayerProfile, ref: dict[str, Any], args: Any, config: Any, budget: float,
                 options: SolveOptions, log: Callable[[str], None] = _log, *, isolate: bool = False) -> Policy:
    """The policy of the run ``args``/``config`` describe, from the layer's profile: every pipeline stage solved for
    its own layers, its own model states and the micro-batches it holds in flight under 1F1B
    (:func:`~megatron_adacc.adacc.policy.solver.solve_stage`), joined into one policy of every layer (global layer
    numbers) from which each stage installs its slice. A stage that fits no policy refuses the run with the
    largest budget any stage needs. ``isolate``: the solves run in a forked child (:func:`isolated_solves`)."""
    pipeline = stage_layout(args, config)
    signature = model_signature(config, args)
    charged = [(charge_static(layer, args, config, stage, parameters), layers, held)
               for stage, (parameters, layers, held) in enumerate(pipeline)]

    def solve_all() -> list[Any]:  # pure Python: no torch in a forked child
        answers: list[Any] = []
        for profile, layers, held in charged:
            try:
                answers.append(solve_stage(profile, budget, options, layers=layers, in_flight=held, profile_ref=ref,
                                           signature=signature))
            except InfeasibleBudgetError as exc:
                answers.append(exc)
        return answers

    parts, refusals = [], []
    for stage, ((_, layers, held), answer) in enumerate(zip(charged, forked(solve_all) if isolate else solve_all())):
        if isinstance(answer, InfeasibleBudgetError):
            refusals.append((answer.min_feasible_bytes, stage, answer))
            continue
        part, result = answer
        where = (f"pipeline stage {stage} (layers {stage * layers}-{stage * layers + layers - 1}, {held} "
                 f"micro-batch{'es' if held > 1 else ''} in flight): " if len(pipeline) > 1 else "")
        of = f"of {format_bytes(budget, 2)}" if budget < _UNBOUNDED else "(no budget: a calibration run)"
        log(f"{where}policy solved by {result.strategy} in {result.solve_time_s * 1e3:.0f} ms ({part.summary()}): "
            f"predicted {format_bytes(result.predicted_memory_bytes, 2, like=budget)} {of}, "
            f"overhead {result.predicted_time_s / held * 1e3:.1f} ms per micro-batch")
        parts.append(part)
    if refusals:
        need, stage, exc = max(refusals, key=lambda r: r[0])
        if len(pipeline) == 1:
            raise exc
        raise InfeasibleBudgetError(budget, need, f" (pipeline stage {stage}, the stage that needs the most)")
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    strategies = " / ".join(part.solver.get("strategy", "-") for part in parts)
    policy = Policy.join(parts, signature=signature, budget_bytes=first.budget_bytes, profile=first.profile,
                         name=first.name, solver={**first.solver, "strategy": strategies,
                                                  "solve_time_s": sum(p.solver["solve_time_s"] for p in parts)})
    policy.op_costs = op_costs(layer, policy)
    return policy


def process_baseline(args: Any, profile: LayerProfile, ref: dict[str, Any], resident: int,
                     log: Callable[[str], None] = _log) -> int:
    """On the CPU the budget is peak RSS, which also counts what the cost model does not: the interpreter,
    torch, megatron-core, and the buffers the framework creates once training runs. The figure is calibrated
    once per profile and micro-batch size, from a short keep-everything run of the user's own command that the
    host runs in a child process (:mod:`megatron_adacc.core.host`) under :data:`LOW_FRAGMENTATION_MALLOC`: its
    measured peak minus the cost model's prediction for it. Without a host that can run one, this process's
    resident size now (``resident``)."""
    db, key = ProfileDB(ref["db"]), _run_key(args)
    baseline = _stored_baseline(db, int(ref["id"]), args)
    if baseline is None:
        on_rank0(lambda: _calibrate(args, profile, ref, db, key, log))
        baseline = db.get_baseline(int(ref["id"]), key)
    if baseline is not None:
        log(f"CPU: the budget is peak RSS; counting {baseline / 2**20:.0f} MiB of process memory outside the "
            f"cost model (calibrated for {key} on profile #{ref['id']})")
        return baseline
    log(f"CPU: the budget is peak RSS; counting this process's {resident / 2**20:.0f} MiB (interpreter and "
        "libraries) as static memory. Buffers created once training runs are not in it: keep "
        "--adacc-memory-headroom for them")
    return resident


#: The allocator setting a process baseline is measured under. With glibc's default one, peak RSS also keeps
#: freed buffers, which no memory model predicts and which vary run to run (docs/measuring.md); the budget
#: on the CPU is live memory as peak RSS shows it under this setting, the one every memory benchmark uses.
LOW_FRAGMENTATION_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _run_key(args: Any, *, full: bool = False) -> str:
    """What a calibrated process baseline depends on besides the profile: the micro-batch, the allocator, the
    calibration's length where it was shorter than :data:`CALIBRATION_STEPS` (``full``: the key of a full-length
    one), and the MILP backend loaded into the process (:func:`_calibrate`): ``forked`` where the calibration's
    solves ran in a child (:func:`isolated_solves`: a fresh process on a system that forks), which loads none.
    ``peak=own``: calibrations stored before the peak was the child's own (core.devices.peak_resident_bytes)
    counted the training process that launched them, and are not reused; nor are those without a ``milp`` (their
    run loaded no solver), or with a backend (their process held it).
    A run of several processes adds its layout: its ranks hold their own stages and shards, and a host measures
    them all."""
    if hasattr(os, "fork"):
        milp = "forked"
    else:
        from megatron_adacc.adacc.policy.strategies.base import select_backend

        milp = select_backend()
    key = (f"micro_batch_size={getattr(args, 'micro_batch_size', None)};malloc=MALLOC_MMAP_THRESHOLD_=65536;"
           f"peak=own;milp={milp}")
    if not full and (steps := calibration_steps(args)) < CALIBRATION_STEPS:
        key += f";steps={steps}"
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if distributed else 1
    if world > 1:
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
        key += f";world={world};tp={tp};pp={pp}"
    return key


#: Set on the arguments of a calibration run (never a flag): the run solves its own policy as the user's
#: ``auto`` does, and must not calibrate in turn. Set to :data:`COMPRESSING`, the run installs every op's
#: layer-specific codec instead (:func:`codec_pages`).
CALIBRATION_RUN = "adacc_calibration_run"
COMPRESSING = "compressing"
#: The run key's suffix under which a calibration stores :func:`codec_pages`.
_CODEC_PAGES = ";codec_pages"


def codec_pages(args: Any, ref: dict[str, Any]) -> int:
    """What a compressing policy's process holds beyond a keep-everything one's, as this profile's calibration
    measured it for this run (:func:`_calibrate`); 0 where it measured none (several ranks, no trace)."""
    return _stored_baseline(ProfileDB(ref["db"]), int(ref["id"]), args, _CODEC_PAGES) or 0


def _stored_baseline(db: ProfileDB, profile_id: int, args: Any, suffix: str = "") -> int | None:
    """The calibration stored for this run: its own, else a full-length one, which a shorter run may take (its
    heap has grown over more steps than the run will take, so it over-counts rather than under-counts)."""
    for key in dict.fromkeys([_run_key(args), _run_key(args, full=True)]):
        if (found := db.get_baseline(profile_id, key + suffix)) is not None:
            return found
    return None


#: Steps of each calibration run. A process's heap grows over its steps before it settles, Megatron's alone as
#: much as Adacc's: on llama-tiny, from step 8 to 30, Megatron without recompute by 1.6 MiB, Adacc keeping
#: everything by 0.9 (2.6 MiB from step 2 to 6 with a compressing policy). Calibrated at 8 steps, 30-step runs
#: of lossless policies peaked up to 1.2 MiB over their predictions; the budget is a peak over the whole run.
CALIBRATION_STEPS = 30


def calibration_steps(args: Any) -> int:
    """Steps of each calibration run for the run of ``args``: :data:`CALIBRATION_STEPS`, or the run's own
    length where that is shorter (a smoke test of 3 steps): a run never peaks in steps it does not take, and
    a calibration run costs its start plus its steps. A shorter calibration is stored under its own length
    (:func:`_run_key`), so a longer run never reuses it."""
    iters = getattr(args, "train_iters", None)
    return min(CALIBRATION_STEPS, int(iters)) if iters else CALIBRATION_STEPS


#: The budget a calibration run solves for: one every policy fits, so the solver keeps everything (the fastest).
_UNBOUNDED = 2**62


def _calibrate(args: Any, profile: LayerProfile, ref: dict[str, Any], db: ProfileDB, key: str,
               log: Callable[[str], None]) -> None:
    """Measure a short keep-everything run of the user's command and store its process baseline, and a
    compressing one for :func:`codec_pages_from_runs` (one process: several ranks store no such figure).

    The run is ``auto`` itself under a budget every policy fits, so its process holds what the user's holds
    besides activations: the profile database and, where the solves do not run in a child (:func:`isolated_solves`),
    PuLP, the MILP backend and the solver's working memory."""
    from megatron_adacc.core import host

    runner = host.current()
    if not runner.runs_training:
        return
    steps = calibration_steps(args)
    log(f"calibrating the process memory: {steps} keep-everything steps of this command ({runner.name}), "
        "and compressing ones, in child processes, once per profile, micro-batch size and parallel layout")

    def measured(trace: bool, run: bool | str = True) -> dict | None:
        return runner.measure_run(args, env=LOW_FRAGMENTATION_MALLOC, adacc_policy="auto",
                                  train_iters=steps, adacc_no_evolution=True, adacc_predict_memory=False,
                                  adacc_memory_budget=_UNBOUNDED, adacc_memory_headroom=0.0,
                                  adacc_process_baseline_bytes=None, adacc_trace_backward=trace,
                                  **{CALIBRATION_RUN: run})

    # The peak comes from a run exactly as the user's runs: a traced one runs keep-everything layers through
    # the runtime's decomposition instead of megatron's forward.
    run = measured(False)
    ranks = (run or {}).get("ranks") or [run]
    traced_run = measured(True) if run is not None and len(ranks) == 1 and stages.supported() else None
    if run is None:
        log("calibration run failed; its error is above")
        return
    reports = [((r.get("extensions") or {}).get("adacc") or {}) for r in ranks]
    decisions = {d for report in reports for d in report.get("decisions") or {}}
    if decisions != {"keep"}:
        log(f"calibration run did not keep everything ({sorted(decisions)}); no process memory stored")
        return
    if len(ranks) > 1:
        # each rank against its own stage's prediction (its layers, micro-batches in flight, model states); the
        # largest excess, so that no rank's process memory is under-counted
        db.put_baseline(int(ref["id"]), key, max(int(r["peak_memory_bytes"]) - int(report["predicted_peak_bytes"])
                                                 for r, report in zip(ranks, reports)))
        return
    traced = ((traced_run or {}).get("extensions") or {}).get("adacc", {}).get("backward_stages") or []
    baseline = baseline_from_run(profile, int(run["peak_memory_bytes"]), traced)
    db.put_baseline(int(ref["id"]), key, baseline)
    if getattr(args, "adacc_codec", None) != "none" and stages.supported():  # a lossless run never compresses
        # What a compressing policy's process holds beyond a keep-everything one's: the pages of the codecs'
        # kernels, and a heap that their small tensors (scales, outlier indices) grow over the first steps. Seen
        # at the stages: on llama-tiny the compressing run's peak was predicted within 0.6 MiB while its
        # forward began 3 MiB over.
        compressing = measured(True, COMPRESSING)
        if compressing is not None:
            traced = ((compressing.get("extensions") or {}).get("adacc") or {}).get("backward_stages") or []
            db.put_baseline(int(ref["id"]), key + _CODEC_PAGES, max(0, baseline_from_run(
                profile, int(compressing["peak_memory_bytes"]), traced, compressing=True) - baseline))


def baseline_from_run(profile: LayerProfile, peak_bytes: int, traced: list[dict[str, Any]], *,
                      compressing: bool = False) -> int:
    """The process memory outside the cost model, from a keep-everything run of ``profile``'s model (with
    ``compressing``, a run compressing every op with its layer-specific codec): what its peak exceeds the model's
    prediction by, or, where the run was traced, the largest excess of a measured stage over its bound
    (:func:`~megatron_adacc.adacc.runtime.stages.bounds`) among the head and the backward and forward stages of
    the last layer (the bound's own case) when that is larger, so that no stage of the calibration run is
    predicted under what it measured. The peak counts as well because it need not be in a traced stage (the
    trace covers the first micro-batch of a step, not the optimizer step or what runs before training)."""
    from megatron_adacc.adacc.policy.solver import make_problem

    problem = make_problem(profile, None, SolveOptions())
    picks = problem.stock_picks()
    if compressing:
        picks = [next((k for k, c in enumerate(cs) if c.decision.action == Action.COMPRESS), keep)
                 for cs, keep in zip(problem.choices, picks)]
    n = problem.num_layers
    stored = problem.layer_memory(picks, stash=True)
    bound = stages.bounds(problem.fixed_bytes, problem.workspace_bytes, [stored] * n,
                          [problem.stage_bytes(picks, stash=True)] * n,
                          [problem.forward_stages(picks, stash=True)] * n)
    last = (f"L{n - 1}/", f"F{n - 1}/")
    excess = [s["peak_bytes"] - bound[s["stage"]] for s in traced
              if s["stage"] == "head" or s["stage"].startswith(last) and s["stage"] in bound]
    return int(round(max([peak_bytes - problem.total_memory([picks] * n, stash=True), *excess])))
