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

from megatron_adacc.core.extension import TrainingContext, TrainingExtension


class AdaccExtension(TrainingExtension):
    """Runs the model's layers under an Adacc policy and reports measured vs predicted memory."""

    name = "adacc"

    def __init__(self, policy: Any, config: Any, predict_memory: bool = True):
        from megatron_adacc.adacc.integration import install

        self.policy = install(policy, config=config, predict_memory=predict_memory)
        self._meter = None
        self._outer_bytes = 0
        self._params: list = []
        self._first_micro = True

    def setup(self, ctx: TrainingContext) -> None:
        self._params = [p for m in ctx.model for p in m.parameters()]

    def on_step_begin(self, iteration: int) -> None:
        self._first_micro = True

    def microbatch_context(self) -> AbstractContextManager:
        from megatron_adacc.core.saved import SavedTensorMeter

        if not self._first_micro:
            return contextlib.nullcontext()
        self._first_micro = False
        meter = SavedTensorMeter(self._params)

        @contextlib.contextmanager
        def metered():
            with meter:
                yield
            self._outer_bytes = meter.nbytes

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
            "nonfinite_fallbacks": sum(r["measured"].nonfinite_fallbacks for r in rep["layers"]),
            "saved_activation_bytes": self._outer_bytes + rep["measured_bytes"] + rep["shared_bytes"],
        }
        errors = [r["rel_error"] for r in rep["layers"] if r.get("rel_error") is not None]
        if errors:
            out["max_rel_error"] = max(errors)
        return out


def build_extension(args: Any, config: Any) -> AdaccExtension:
    """The extension for ``--adacc-policy`` (called by ``adacc train`` before the model is built).

    ``auto`` profiles (or reuses the stored profile) and solves the MILP; a file is checked against this model's
    signature; presets are sized to the model.
    """
    from megatron_adacc.adacc.integration.auto import resolve_policy

    policy = resolve_policy(args, config)
    # ADACC_PREDICT_MEMORY=0 skips the per-layer size profile (one extra layer forward at step 1), which would
    # otherwise show in peak-memory benchmarks.
    predict = os.environ.get("ADACC_PREDICT_MEMORY", "1") != "0"
    return AdaccExtension(policy, config, predict_memory=predict)


def build_extensions(args: Any, config: Any) -> list[TrainingExtension]:
    """``--adacc-policy``'s extensions: the policy's, then evolution's when the policy was solved (``auto``)
    and evolution is not turned off: only a solved policy carries the profile and budget it re-solves against."""
    from megatron_adacc.adacc.integration.evolution import build_extension as evolution_extension
    from megatron_adacc.adacc.policy import Policy

    adacc = build_extension(args, config)
    evolution = evolution_extension(args, config, adacc.policy) if isinstance(adacc.policy, Policy) else None
    return [adacc] if evolution is None else [adacc, evolution]
