"""A plan: per-GPU memory of every method for a model, a parallel layout and a micro-batch, the largest micro-batch
each fits on a GPU, Adacc's policy, and predicted step times, all without a GPU.

Every method is a policy on the same profile (:mod:`.profile`) evaluated by the solver's own cost model, so they
are compared on equal terms: Megatron's three recompute modes are the policies that hold what each holds
(``none`` keeps everything, ``selective`` recomputes inside the core attention, ``full`` keeps the layer's
checkpoint),
Adacc's is solved for the budget, and the paper's Quantization baseline is INT4 everywhere. Each pipeline stage is
planned for its own layers, its model states and, under 1F1B, the micro-batches it holds in flight; the plan is
the worst stage's.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_adacc.adacc.integration.model_states import (
    ModelParameters,
    StaticMemory,
    charge_static,
    count_parameters,
    static_memory,
)
from megatron_adacc.adacc.integration.profiler import CUDA_DEFAULT_FRACTION
from megatron_adacc.adacc.planner.layout import Layout, fake_groups
from megatron_adacc.adacc.planner.profile import planned_profile
from megatron_adacc.adacc.planner.roofline import memory_bound_seconds
from megatron_adacc.adacc.planner.sizing import FakeModel, fake_tensors
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.adacc.policy.profile import LayerProfile
from megatron_adacc.adacc.policy.signature import model_signature
from megatron_adacc.adacc.policy.solver import SolveOptions, evaluate_stage, solve_stage
from megatron_adacc.adacc.policy.static import StateBytes, in_flight
from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError
from megatron_adacc.core.errors import AdaccError
from megatron_adacc.core.gpus import GpuSpec
from megatron_adacc.core.log import progress
from megatron_adacc.core.units import format_bytes

#: Megatron's selective recompute (its default ``--recompute-modules core_attn``) as Adacc's ops: its checkpoint
#: drops what the core attention holds inside (the scores, probabilities and dropout) and returns its output, which
#: the output projection saves as it does without recompute; so ``context``, whose decision covers that output, is
#: kept. (With an SDPA kernel the three are empty: the kernel's log-sum-exp, which Megatron's checkpoint drops, stays.)
CORE_ATTENTION_OPS = ("scores", "softmax", "dropout")
#: The largest micro-batch a search tries.
MAX_MICRO_BATCH = 4096


class PlanError(AdaccError, ValueError):
    """A request no plan can answer (nothing fits the GPU, ...): the message says what to change."""


@dataclass(frozen=True)
class Method:
    """One way of holding activations, as the plan compares them."""

    name: str
    label: str
    policy: Callable[[int], Policy] | None
    """The policy for ``n`` layers; None: solved for the budget (Adacc)."""


METHODS: tuple[Method, ...] = (
    Method("megatron_none", "Megatron, no recompute", Policy.all_keep),
    Method("megatron_selective", "Megatron selective recompute",
           lambda n: Policy.uniform(dict.fromkeys(CORE_ATTENTION_OPS, "recompute"), n, name="selective")),
    Method("megatron_full", "Megatron full recompute", Policy.all_recompute),
    Method("quantization", "INT4 everywhere (paper's Quantization)", Policy.quantize_all),
    Method("adacc", "Adacc (solved for the budget)", None),
)
METHODS_BY_NAME = {m.name: m for m in METHODS}


@dataclass
class StagePlan:
    """One pipeline stage under one method, for one micro-batch."""

    stage: int
    layers: int
    in_flight: int
    static: StaticMemory
    held_bytes: float
    """Activations held for backward by the stage's layers (their inputs included) for every micro-batch in
    flight."""
    transient_bytes: float
    """The transient at the peak on top of them: the logits workspace or a layer's backward, the larger."""
    micro_batch_s: float
    """Predicted time of one micro-batch's forward and backward through the stage (a roofline)."""
    policy: Policy

    @property
    def total_bytes(self) -> float:
        return self.static.state_bytes + self.held_bytes + self.transient_bytes


@dataclass
class MethodPlan:
    """A method on every stage; ``stages`` is None where it does not fit (Adacc: no policy fits the budget)."""

    method: Method
    stages: list[StagePlan] | None
    budget_bytes: float
    need_bytes: float | None = None
    """Adacc without a policy: the smallest budget one fits."""

    @property
    def worst(self) -> StagePlan | None:
        return None if self.stages is None else max(self.stages, key=lambda s: s.total_bytes)

    @property
    def fits(self) -> bool:
        worst = self.worst
        return worst is not None and worst.total_bytes <= self.budget_bytes


@dataclass
class Plan:
    """Every method for one micro-batch (:meth:`Planner.plan`)."""

    micro_batch: int
    methods: dict[str, MethodPlan]
    num_microbatches: int
    optimizer_s: float
    """Predicted time of the optimizer's update on the stage with the most parameters."""
    largest: dict[str, int] = field(default_factory=dict)
    """Each method's largest micro-batch (empty: not searched)."""
    sweep: dict[int, dict[str, float | None]] = field(default_factory=dict)
    """Predicted step time of each method at other micro-batches (None where it does not fit)."""

    def step_s(self, name: str) -> float | None:
        """Predicted time of one iteration: the slowest stage paces 1F1B, which runs ``M + P - 1`` micro-batch
        slots, then the optimizer's update (communication is not in the roofline)."""
        plan = self.methods[name]
        if plan.stages is None:
            return None
        slowest = max(s.micro_batch_s for s in plan.stages)
        return (self.num_microbatches + len(plan.stages) - 1) * slowest + self.optimizer_s


def optimizer_seconds(parameters: int, per: StateBytes, shards: int, gpu: GpuSpec) -> float:
    """Adam's update streams memory: it reads and writes the optimizer states (the fp32 main parameters among
    them), and reads its shard of the gradients and writes its shard of the parameters."""
    return memory_bound_seconds(parameters * (2 * per.optimizer + (per.gradients + per.parameters) / shards), gpu)


class Planner:
    """Plans for one model, layout and GPU; use it as a context manager (its fake model lives inside one
    ``FakeTensorMode``). Profiles are made once per micro-batch and kept."""

    def __init__(self, args: Any, config: Any, layout: Layout, gpu: GpuSpec, memory_bytes: int | None = None, *,
                 budget_bytes: int | None = None, options: SolveOptions | None = None, target: str = "cuda",
                 masked_softmax_fusion: bool = True) -> None:
        layout.check(config, args.seq_length)
        self.args, self.layout, self.gpu = args, layout, gpu
        self.config = layout.shard(config)
        self.memory_bytes = int(memory_bytes or gpu.memory_bytes)
        #: The budget as ``auto`` takes it on CUDA by default: room for the caching allocator's slack.
        self.budget_bytes = int(budget_bytes or CUDA_DEFAULT_FRACTION * self.memory_bytes)
        self.options = options or SolveOptions()
        self.target, self.masked_softmax_fusion = target, masked_softmax_fusion
        self.parameters: ModelParameters = count_parameters(args, self.config, fake_groups(layout))
        self.signature = model_signature(self.config, args)
        self._profiles: dict[tuple[int, bool], LayerProfile] = {}
        self._stack = contextlib.ExitStack()
        self._model: FakeModel | None = None

    def __enter__(self) -> Planner:
        self._stack.enter_context(fake_tensors(self.target))
        self._model = FakeModel(self.args, self.config, self.layout, self.target, self.masked_softmax_fusion)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._model = None
        self._profiles.clear()
        self._stack.close()

    @property
    def usable_bytes(self) -> float:
        """What a plan may fill: the budget less the solver's headroom (the same test for every method)."""
        return self.options.usable_bytes(self.budget_bytes)

    def profile(self, micro_batch: int, timed: bool = True) -> LayerProfile:
        """The planned profile for ``micro_batch`` (:func:`~.profile.planned_profile`), made once."""
        if self._model is None:
            raise RuntimeError("use the Planner inside `with Planner(...) as planner:`")
        key = (micro_batch, timed)
        if key not in self._profiles:
            self._profiles[key] = planned_profile(self._model, micro_batch, self.gpu, self.signature, timed=timed)
        return self._profiles[key]

    def args_for(self, micro_batch: int) -> Any:
        """The run's arguments with micro-batch ``micro_batch``."""
        args = copy.copy(self.args)
        args.micro_batch_size = micro_batch
        return args

    # ----------------------------------------------------------------------------------------- one method
    def method(self, method: Method, micro_batch: int, timed: bool = True) -> MethodPlan:
        """``method`` on every pipeline stage for micro-batch ``micro_batch`` (no times without ``timed``)."""
        stages = []
        for stage in range(self.layout.pipeline):
            planned = self._stage(method, micro_batch, stage, timed)
            if isinstance(planned, InfeasibleBudgetError):
                return MethodPlan(method, None, self.usable_bytes, planned.min_feasible_bytes)
            stages.append(planned)
        return MethodPlan(method, stages, self.usable_bytes)

    def _stage(self, method: Method, micro_batch: int, stage: int, timed: bool) -> StagePlan | InfeasibleBudgetError:
        layers, pipeline = self.parameters.layers_per_stage, self.layout.pipeline
        held = in_flight(stage, pipeline)
        profile = charge_static(self.profile(micro_batch, timed), self.args_for(micro_batch), self.config, stage,
                                self.parameters)
        if method.policy is None:
            try:
                policy, _ = solve_stage(profile, self.budget_bytes, self.options, layers=layers, in_flight=held)
            except InfeasibleBudgetError as exc:
                return exc
        else:
            policy = method.policy(layers)
        ev = evaluate_stage(profile, policy, held, chain_aware=self.options.chain_aware)
        last = stage == pipeline - 1
        seconds = layers * profile.step_time_s + ev["time_s"] / held + (profile.meta["ends_s"] if last else 0.0)
        static = static_memory(self.args_for(micro_batch), self.config, stage, self.parameters)
        return StagePlan(stage, layers, held, static, ev["memory_bytes"] - ev["transient_bytes"] - ev["static_bytes"],
                         ev["transient_bytes"], seconds, policy)

    # --------------------------------------------------------------------------------------- every method
    def plan(self, micro_batch: int) -> Plan:
        """Every method for ``micro_batch`` (:data:`METHODS`)."""
        methods = {m.name: self.method(m, micro_batch) for m in METHODS}
        per = static_memory(self.args_for(micro_batch), self.config, 0, self.parameters).per_parameter
        shards = self.layout.data if self.layout.distributed_optimizer else 1
        most = max(self.parameters.stage(i) for i in range(self.layout.pipeline))
        global_batch = getattr(self.args, "global_batch_size", None) or micro_batch * self.layout.data
        return Plan(micro_batch, methods, max(1, global_batch // (micro_batch * self.layout.data)),
                    optimizer_seconds(most, per, shards, self.gpu))

    def fits(self, method: Method, micro_batch: int) -> bool:
        return self.method(method, micro_batch, timed=False).fits

    def largest(self, method: Method, limit: int = MAX_MICRO_BATCH, tick: Callable[[], Any] | None = None) -> int:
        """The largest micro-batch ``method`` fits (0: not even one; ``limit`` where the search stopped)."""
        def fits(b: int) -> bool:
            if tick is not None:
                tick()
            return self.fits(method, b)

        if not fits(1):
            return 0
        low, high = 1, 2
        while high <= limit and fits(high):
            low, high = high, high * 2
        if high > limit:
            return low
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low


def make_plan(planner: Planner, micro_batch: int, *, search: bool = True, sweep: tuple[int, ...] = ()) -> Plan:
    """The plan for ``micro_batch``, with each method's largest micro-batch when ``search`` and its predicted step
    time at each micro-batch of ``sweep`` (a progress bar over the trials: each sizes a micro-batch once)."""
    plan = planner.plan(micro_batch)
    trials = len(METHODS) * 2 * int(math.log2(MAX_MICRO_BATCH) + 1) * search + len(sweep)
    with progress(total=trials, desc="plan", unit="trial") as bar:
        if search:
            plan.largest = {m.name: planner.largest(m, tick=bar.update) for m in METHODS}
        for b in sweep:
            other = planner.plan(b)
            plan.sweep[b] = {m.name: other.step_s(m.name) if other.methods[m.name].fits else None for m in METHODS}
            bar.update()
    return plan


def nothing_fits(planner: Planner, plan: Plan) -> None:
    """Refuse, in one line, a request no method can run: not one micro-batch fits the GPU, whatever the method.
    Says what the model states alone take and what to change."""
    if any(m.fits for m in plan.methods.values()) or any(plan.largest.values()):
        return
    if plan.largest == {} and plan.micro_batch > 1 and any(planner.fits(m, 1) for m in METHODS):
        return  # no search was asked for: a smaller micro-batch fits
    worst = max(range(planner.layout.pipeline), key=planner.parameters.stage)
    states = static_memory(planner.args_for(1), planner.config, worst, planner.parameters).state_bytes
    adacc = planner.method(METHODS_BY_NAME["adacc"], 1, timed=False)
    need = f", Adacc at least {format_bytes(adacc.need_bytes, 2)}" if adacc.need_bytes else ""
    raise PlanError(
        f"nothing fits {planner.gpu.name} with a budget of {format_bytes(planner.usable_bytes, 2)}: the model "
        f"states of pipeline stage {worst} alone take {format_bytes(states, 2)}{need} at micro-batch 1; split the "
        "model further (--tensor-model-parallel-size, --pipeline-model-parallel-size), shard the optimizer "
        "(--use-distributed-optimizer with --data-parallel-size), or plan a larger GPU (--device)")
