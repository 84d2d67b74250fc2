"""``adacc plan``'s text and JSON: the per-GPU memory of every method, the largest micro-batches, predicted step
times (labelled as predictions wherever they appear) and Adacc's policy."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from megatron_adacc.adacc.planner.plan import MAX_MICRO_BATCH, METHODS, Plan, Planner
from megatron_adacc.adacc.policy.ops import OP_NAMES, Action
from megatron_adacc.core.tables import WIDTH, format_table
from megatron_adacc.core.units import format_bytes

#: Column heads of the methods (the table must fit 100 columns).
SHORT = {"megatron_none": "Megatron\nnone", "megatron_selective": "Megatron\nselective",
         "megatron_full": "Megatron\nfull", "quantization": "INT4\neverywhere", "adacc": "Adacc"}


def _gib(n: float | None) -> str:
    return "-" if n is None else format_bytes(n, 2)


def _prose(text: str) -> str:
    return textwrap.fill(text, WIDTH)


def header(planner: Planner, plan: Plan) -> str:
    args, sig, layout, gpu = planner.args, planner.signature, planner.layout, planner.gpu
    vocab = sig["vocab_size"]
    given = getattr(args, "vocab_size", None)
    padded = f" (padded from {given})" if given and given != vocab else ""
    groups = sig["num_query_groups"]
    grouped = "" if groups == sig["num_attention_heads"] else f" ({groups} key/value groups)"
    model = (f"{sig['num_layers']} layers, hidden {sig['hidden_size']}, {sig['num_attention_heads']} heads{grouped}, "
             f"FFN {sig['ffn_hidden_size']}, sequence {sig['seq_length']}, vocabulary {vocab}{padded}, "
             f"{'untied' if sig['untie_embeddings_and_output_weights'] else 'tied'} embeddings, {sig['dtype']}, "
             f"{sig['attention']} attention")
    lines = [_prose(f"model: {model}"),
             _prose(f"layout: {layout.describe()}; micro-batch {plan.micro_batch}, {plan.num_microbatches} "
                    f"micro-batch(es) per step and data-parallel rank; {planner.parameters.stage(0):,} parameters "
                    "on each GPU of the first pipeline stage"),
             _prose(f"GPU: {gpu.name}, {format_bytes(planner.memory_bytes, 1)}; budget "
                    f"{format_bytes(planner.budget_bytes, 2)} (what auto takes on CUDA by default), of which a plan "
                    f"fills {format_bytes(planner.usable_bytes, 2)} (the solver's headroom)")]
    return "\n".join(lines)


def memory_table(plan: Plan) -> str:
    """Per-GPU bytes of each method on its worst pipeline stage (the stage and the micro-batches it holds in
    flight under 1F1B, with pipeline parallelism). The total adds the transient at the peak, the larger of the
    logits workspace and a layer's backward, to the model states and the activations held."""
    rows: list[list[str]] = []
    worst = {name: m.worst for name, m in plan.methods.items()}

    def row(label: str, value) -> None:
        rows.append([label] + [value(worst[m.name]) if worst[m.name] is not None else "-" for m in METHODS])

    if len(next(m for m in plan.methods.values() if m.stages is not None).stages) > 1:
        row("stage (in flight)", lambda s: f"{s.stage} ({s.in_flight})")
    row("parameters", lambda s: _gib(s.static.parameter_bytes))
    row("gradients", lambda s: _gib(s.static.gradient_bytes))
    row("optimizer states", lambda s: _gib(s.static.optimizer_bytes))
    row("activations held", lambda s: _gib(s.held_bytes))
    row("logits workspace", lambda s: _gib(s.static.workspace_bytes))
    row("transient at the peak", lambda s: _gib(s.transient_bytes))
    row("total", lambda s: _gib(s.total_bytes))
    rows.append(["fits the budget"] + ["yes" if plan.methods[m.name].fits else "no" for m in METHODS])
    return format_table([f"per GPU, micro-batch {plan.micro_batch}"] + [SHORT[m.name] for m in METHODS], rows,
                        right=range(1, len(METHODS) + 1))


def search_table(plan: Plan) -> str:
    cells = []
    for m in METHODS:
        b = plan.largest.get(m.name)
        cells.append("-" if b is None else "none" if b == 0 else f">= {b}" if b >= MAX_MICRO_BATCH else str(b))
    return format_table(["largest micro-batch"] + [SHORT[m.name] for m in METHODS], [[""] + cells],
                        right=range(1, len(METHODS) + 1))


def time_table(plan: Plan) -> str:
    """Predicted step times (a roofline) and their ratios to Megatron without recompute and with full recompute."""
    steps = {m.name: plan.step_s(m.name) for m in METHODS}

    def ratio(name: str, base: str) -> str:
        return "-" if steps[name] is None or not steps[base] else f"{steps[base] / steps[name]:.2f}x"

    rows = [["step time (predicted)"] + [f"{steps[m.name] * 1e3:.0f} ms" if steps[m.name] else "-" for m in METHODS],
            ["speed vs Megatron none"] + [ratio(m.name, "megatron_none") for m in METHODS],
            ["speed vs Megatron full"] + [ratio(m.name, "megatron_full") for m in METHODS]]
    return format_table([f"at micro-batch {plan.micro_batch}"] + [SHORT[m.name] for m in METHODS], rows,
                        right=range(1, len(METHODS) + 1))


def sweep_table(plan: Plan) -> str:
    """Predicted step time of each method that fits, at each micro-batch of the sweep."""
    rows = [[str(b)] + [f"{t[m.name] * 1e3:.0f} ms" if t[m.name] else "-" for m in METHODS]
            for b, t in sorted(plan.sweep.items())]
    return format_table(["micro-batch (predicted)"] + [SHORT[m.name] for m in METHODS], rows,
                        right=range(1, len(METHODS) + 1))


def recompute_share(plan: Plan) -> float | None:
    """Full recompute's share of its own step time, predicted: the paper's motivating figure (28% for GPT-345M)."""
    full, none = plan.step_s("megatron_full"), plan.step_s("megatron_none")
    return None if not full or none is None else (full - none) / full


def policy_table(planner: Planner, plan: Plan) -> str:
    """Adacc's decisions for one layer of each stage (every layer of a stage takes the same when micro-batches are in
    flight; otherwise the most common), with the bytes each op holds."""
    adacc = plan.methods["adacc"]
    if adacc.stages is None:
        return _prose(f"Adacc: no policy fits; the smallest budget one fits is {_gib(adacc.need_bytes)}")
    profile = planner.profile(plan.micro_batch)
    parts = []
    for stage in adacc.stages:
        layers = stage.policy.layers
        layer = max(layers, key=layers.count)
        rows = []
        for name, decision, op in zip(OP_NAMES, layer, profile.ops):
            if op.saved_bytes == 0 and decision.action == Action.KEEP:
                continue
            stored = {Action.KEEP: op.saved_bytes, Action.RECOMPUTE: 0}.get(
                decision.action, op.codecs[decision.codec].compressed_bytes if decision.codec in op.codecs else None)
            rows.append([name, decision.label, _gib(op.saved_bytes), _gib(stored)])
        same = layers.count(layer)
        title = f"Adacc's policy, stage {stage.stage}: {same} of its {len(layers)} layers"
        parts.append(title + "\n" + format_table(["op", "decision", "if kept", "stored"], rows, right=(2, 3)))
    return "\n\n".join(parts)


def render(planner: Planner, plan: Plan) -> str:
    share = recompute_share(plan)
    parts = [header(planner, plan), memory_table(plan),
             _prose("The total is the model states, the activations held and the transient at the peak: the logits "
                    "workspace or a layer's backward (what it brings back), whichever is larger.")]
    if plan.largest:
        parts.append(search_table(plan))
    parts.append(time_table(plan))
    if plan.sweep:
        parts.append(sweep_table(plan))
    notes = [f"Times are predictions: a roofline of every kernel on {planner.gpu.name} (peak arithmetic and memory "
             "bandwidth; no communication, no launch overhead), good for ratios between methods, optimistic in "
             "absolute terms."]
    if share is not None:
        notes.append(f"Predicted share of Megatron full recompute's step spent recomputing: {share:.0%}.")
    parts.append(_prose(" ".join(notes)))
    parts.append(policy_table(planner, plan))
    return "\n\n".join(parts)


def to_json(planner: Planner, plan: Plan) -> dict[str, Any]:
    """The plan as the benchmark table and scripts read it."""
    methods = {}
    for m in METHODS:
        mp = plan.methods[m.name]
        worst = mp.worst
        methods[m.name] = {
            "fits": mp.fits, "largest_micro_batch": plan.largest.get(m.name),
            "predicted_step_time_s": plan.step_s(m.name),
            "peak_memory_bytes": None if worst is None else worst.total_bytes,
            "activation_bytes": None if worst is None else worst.held_bytes,
            "transient_bytes": None if worst is None else worst.transient_bytes,
            "logits_workspace_bytes": None if worst is None else worst.static.workspace_bytes,
            "static_bytes": None if worst is None else worst.static.state_bytes,
            "min_budget_bytes": mp.need_bytes}
    return {"gpu": planner.gpu.name, "memory_bytes": planner.memory_bytes, "budget_bytes": planner.budget_bytes,
            "layout": dataclasses.asdict(planner.layout),
            "micro_batch": plan.micro_batch, "num_microbatches": plan.num_microbatches,
            "signature": planner.signature, "recompute_share": recompute_share(plan), "methods": methods,
            "sweep": {str(b): t for b, t in sorted(plan.sweep.items())}}
