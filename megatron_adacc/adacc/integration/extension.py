"""``adacc train --adacc-policy ...``: install the policy and report the bytes it holds for backward.

The runtime's saved-tensor hooks are the innermost ones inside every transformer layer, so the training loop's
own meter no longer sees the layers' tensors. This extension therefore meters the rest of the model (embedding,
final norm, logits, loss) itself and adds the layers' bytes as the runtime measured them, which makes
``saved_activation_bytes`` comparable with a run without a policy.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import AbstractContextManager
from typing import Any

from megatron_adacc.adacc.runtime.stages import BackwardTrace
from megatron_adacc.core.devices import peak_memory_bytes
from megatron_adacc.core.extension import TrainingContext, TrainingExtension
from megatron_adacc.core.log import get_logger
from megatron_adacc.core.units import format_bytes


class AdaccExtension(TrainingExtension):
    """Runs the model's layers under an Adacc policy and reports measured vs predicted memory."""

    name = "adacc"
    state_optional = True

    def __init__(self, policy: Any, config: Any, predict_memory: bool = True, budget_bytes: int | None = None,
                 trace_backward: bool = False):
        from megatron_adacc.adacc.integration import install

        self.policy = install(policy, config=config, predict_memory=predict_memory)
        self.budget_bytes = budget_bytes
        self.trace_backward = trace_backward
        self._stages: list = []
        self._meter = None
        self._outer_bytes = 0
        self._params: list = []
        self._first_micro = True

    def setup(self, ctx: TrainingContext) -> None:
        from megatron_adacc.adacc.runtime.capacity import CAPACITIES

        self._params = [p for m in ctx.model for p in m.parameters()]
        CAPACITIES.clear()  # a run starts from its checkpoint's capacities, or measures them afresh

    def on_step_begin(self, iteration: int) -> None:
        self._first_micro = True

    def state_dict(self) -> dict:
        """The outlier codec's learned capacities, so a resumed run compresses as a straight one would."""
        from megatron_adacc.adacc.runtime.capacity import CAPACITIES

        return {"outlier_capacities": CAPACITIES.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        from megatron_adacc.adacc.runtime.capacity import CAPACITIES

        if "outlier_capacities" in state:
            CAPACITIES.load_state_dict(state["outlier_capacities"])

    def microbatch_context(self) -> AbstractContextManager:
        from megatron_adacc.core.saved import SavedTensorMeter

        if not self._first_micro:
            return contextlib.nullcontext()
        self._first_micro = False
        meter = SavedTensorMeter(self._params)

        @contextlib.contextmanager
        def metered():
            with contextlib.ExitStack() as stack:
                trace = stack.enter_context(BackwardTrace()) if self.trace_backward else None
                with meter:
                    yield
                self._outer_bytes = meter.nbytes
            if trace is not None:
                self._stages = trace.stages

        return metered()

    def report(self) -> dict[str, Any]:
        from collections import Counter

        from megatron_adacc.adacc.integration import installed_policy
        from megatron_adacc.adacc.runtime.memory import memory_report

        policy = installed_policy()
        rep = memory_report(policy)
        out: dict[str, Any] = {
            "policy": getattr(policy, "name", None) or str(policy),
            # how many (layer, op) pairs take each decision: which codecs a run used, at a glance
            "decisions": dict(Counter(d.label for layer in getattr(policy, "layers", []) for d in layer)),
            "layer_bytes_measured": rep["measured_bytes"],
            "layer_bytes_predicted": rep.get("predicted_bytes"),
            "layers": [{"layer": r["layer"], "measured_bytes": r["measured_bytes"],
                        "predicted_bytes": r.get("predicted_bytes"), "rel_error": r.get("rel_error")}
                       for r in rep["layers"]],
            "saved_activation_bytes": self._outer_bytes + rep["measured_bytes"] + rep["shared_bytes"],
        }
        errors = [r["rel_error"] for r in rep["layers"] if r.get("rel_error") is not None]
        if errors:
            out["max_rel_error"] = max(errors)
        predicted = getattr(policy, "predicted", None) or {}
        if out["layer_bytes_predicted"] is None and predicted.get("per_layer"):
            # the solver's figure when the layers' sizes were not profiled in this run (--adacc-predict-memory)
            out["layer_bytes_predicted"] = sum(r["activation_bytes"] for r in predicted["per_layer"])
        if "in_flight" in predicted:  # a pipeline stage's policy: the micro-batches its solve held at once
            out["in_flight"] = predicted["in_flight"]
        out.update(self._budget_check(predicted.get("memory_bytes")))
        if self._stages:
            out["backward_stages"] = _stages_report(self._stages, predicted)
        return out

    def _budget_check(self, predicted_peak: int | None) -> dict[str, Any]:
        """The run's peak against its budget; a run over budget says so loudly, with the figures."""
        if self.budget_bytes is None or not self._params:
            return {}
        device = self._params[0].device
        peak = peak_memory_bytes(device)
        over = peak > self.budget_bytes
        if over:
            guess = f", the solver predicted {format_bytes(predicted_peak)}" if predicted_peak else ""
            fix = ("Lower --adacc-memory-budget by the difference or raise --adacc-memory-headroom, and please "
                   "report the figures.")
            if device.type == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
                fix = ("On the CPU the budget counts live memory as peak RSS shows it with "
                       "MALLOC_MMAP_THRESHOLD_=65536; glibc's default allocator also keeps freed buffers "
                       "(docs/measuring.md). Set it, or " + fix[0].lower() + fix[1:])
            get_logger().warning(f"this run peaked at {format_bytes(peak, like=self.budget_bytes)}, OVER its memory "
                                 f"budget of {format_bytes(self.budget_bytes)}{guess}. {fix}")
        return {"budget_bytes": self.budget_bytes, "peak_bytes": peak, "predicted_peak_bytes": predicted_peak,
                "over_budget": over}


def _stages_report(stages: list, predicted: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured peak of each stage, beside the solver's bound for it where the policy has one
    (:func:`~megatron_adacc.adacc.runtime.stages.bounds`)."""
    from megatron_adacc.adacc.runtime.stages import bounds

    per_layer = predicted.get("per_layer") or []
    known: dict[str, float] = {}
    if per_layer and "fixed_bytes" in predicted and all("stage_bytes" in p for p in per_layer):
        forward = [p["forward_bytes"] for p in per_layer] if all(p.get("forward_bytes") for p in per_layer) else ()
        known = bounds(predicted["fixed_bytes"], predicted.get("workspace_bytes", 0),
                       [p["activation_bytes"] for p in per_layer], [p["stage_bytes"] for p in per_layer], forward)
    return [{"stage": s.label, "peak_bytes": s.peak_bytes,
             **({"predicted_bytes": int(round(known[s.label]))} if s.label in known else {})} for s in stages]


def build_extension(args: Any, config: Any) -> AdaccExtension:
    """The extension for ``--adacc-policy`` (called by ``adacc train`` before the model is built).

    ``auto`` profiles (or reuses the stored profile) and solves the MILP; a file is checked against this model's
    signature; presets are sized to the model.
    """
    from megatron_adacc.adacc.integration.policy_source import resolve_policy

    return _extension(args, config, resolve_policy(args, config, isolate=True))


def _extension(args: Any, config: Any, policy: Any) -> AdaccExtension:
    predict = getattr(args, "adacc_predict_memory", None)
    if predict is None:  # the solver's prediction, where there is one, costs nothing at run time
        predict = not (getattr(policy, "predicted", None) or {}).get("per_layer")
    return AdaccExtension(policy, config, predict_memory=bool(predict),
                          budget_bytes=getattr(args, "adacc_memory_budget", None),
                          trace_backward=bool(getattr(args, "adacc_trace_backward", False)))


def build_extensions(args: Any, config: Any) -> list[TrainingExtension]:
    """``--adacc-policy``'s extensions: the policy's, then evolution's when the policy was solved (``auto``)
    and evolution is not turned off. ``auto`` plans out of this process where it can (:mod:`~.planning`)."""
    from megatron_adacc.adacc.integration.planning import plan

    planned = plan(args, config)
    adacc = _extension(args, config, planned.policy)
    if planned.evolution is None:
        return [adacc]  # nothing to re-solve, and the solver (evolution's import) stays unloaded
    from megatron_adacc.adacc.integration.evolution import build_extension as evolution_extension

    evolution = evolution_extension(args, config, adacc.policy, planned.evolution)
    return [adacc] if evolution is None else [adacc, evolution]
