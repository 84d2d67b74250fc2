"""From a profile and a budget to a :class:`Policy`: the entry point ``adacc solve`` and ``auto`` share."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_adacc.adacc.policy.cost_model import Problem, build_problem, tile_mlp, tiled_block_time
from megatron_adacc.adacc.policy.ops import CODEC_FAMILIES, OP_NAMES, OUTLIER_CODEC, Action
from megatron_adacc.adacc.policy.options import HEADROOM_FLOOR_BYTES, SolveOptions  # noqa: F401 (re-exported)
from megatron_adacc.adacc.policy.policy import Policy, check_tiles
from megatron_adacc.adacc.policy.profile import LayerProfile, mlp_weight_bytes
from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError, SolveResult, solve


def make_problem(profile: LayerProfile, budget_bytes: float | None, options: SolveOptions,
                 *, num_layers: int | None = None, compressing: bool = True) -> Problem:
    """The MILP's problem under ``options``; with ``compressing`` False (or the codec family ``none``) no op
    is offered a codec, and the static memory does not carry :attr:`SolveOptions.codec_pages_bytes`."""
    if options.codec_family not in CODEC_FAMILIES:
        raise ValueError(f"codec family must be one of {', '.join(CODEC_FAMILIES)}, got {options.codec_family!r}")
    lossless = options.codec_family == "none" or not compressing
    return build_problem(
        profile, budget_bytes, codecs=options.codecs, num_layers=num_layers,
        static_bytes=profile.static_bytes + options.process_baseline_bytes
        + (0.0 if lossless else options.codec_pages_bytes),
        only_codec="stochastic" if options.codec_family == "gact" else None,
        codec_params={OUTLIER_CODEC: {"z_threshold": float(options.outlier_z)}},
        codec_substitutes=None if options.outlier_separation else {OUTLIER_CODEC: "int4_symmetric"},
        allow=(lambda op, decision: decision.action != Action.COMPRESS) if lossless else None,
    )


def solve_policy(profile: LayerProfile, budget_bytes: float | None, options: SolveOptions | None = None, *,
                 num_layers: int | None = None, profile_ref: dict[str, Any] | None = None,
                 signature: dict[str, Any] | None = None) -> tuple[Policy, SolveResult]:
    """Solve the MILP for ``profile`` under ``budget_bytes`` and wrap the answer as a policy file object.

    Raises :class:`~megatron_adacc.adacc.policy.strategies.InfeasibleBudgetError` (naming the smallest feasible
    budget) when nothing fits.
    """
    options = options or SolveOptions()
    if not 0.0 <= options.headroom < 1.0:
        raise ValueError(f"memory headroom must be a fraction in [0, 1), got {options.headroom}")
    usable = options.usable_bytes(budget_bytes) if budget_bytes is not None else None
    solved: list[tuple[Problem, SolveResult, int]] = []  # with the tiles its MLP re-runs in
    failed: list[InfeasibleBudgetError] = []
    # lossless (--adacc-codec none) promises stock Megatron's gradients bit for bit, which tiles do not keep
    tiling = max(int(options.mlp_tiles), 1) if options.codec_family != "none" else 1
    # a policy that compresses carries the codecs' pages; the best of those that do not may then be faster
    variants = (True, False) if options.codec_pages_bytes and options.codec_family != "none" else (True,)
    for compressing in variants:
        untiled = make_problem(profile, usable, options, num_layers=num_layers, compressing=compressing)
        for tiles in dict.fromkeys((1, tiling)):
            problem = tile_mlp(untiled, tiles, mlp_weight_bytes(profile.signature))
            try:
                result = solve(problem, chain_aware=options.chain_aware, heterogeneous=options.heterogeneous)
            except InfeasibleBudgetError as e:
                failed.append(e)
                continue
            solved.append((problem, result, tiles))
            # every layer of a tiled policy re-runs its MLP: no faster than an untiled one that costs no more
            if tiles == 1 and result.predicted_time_s <= problem.num_layers * tiled_block_time(problem, tiling):
                break
    if not solved:
        e = min(failed, key=lambda e: e.min_feasible_bytes)
        if not options.headroom and not options.headroom_min_bytes:
            raise e
        raise InfeasibleBudgetError(budget_bytes, options.needed_budget(e.min_feasible_bytes),
                                    f" (with {options.headroom_text()}, --adacc-memory-headroom)") from None
    # tiles only where they buy time or fit where nothing untiled does: untiled, gradients stay bit-exact; of
    # equally fast ones, the one holding less (a compressing variant's answer that compresses nothing, say)
    problem, result, _ = min(solved, key=lambda s: (s[1].predicted_time_s, s[2] > 1, s[1].predicted_memory_bytes))
    sig = dict(signature if signature is not None else profile.signature)
    if num_layers is not None:
        sig["num_layers"] = int(num_layers)
    policy = result.to_policy(signature=sig, budget_bytes=int(budget_bytes) if budget_bytes is not None else None,
                              profile_ref=profile_ref, static_bytes=problem.fixed_bytes)
    policy.predicted["static_bytes"] = int(problem.static_bytes)
    policy.predicted["workspace_bytes"] = int(problem.workspace_bytes)
    policy.predicted["activation_bytes"] = int(round(result.predicted_memory_bytes - problem.fixed_bytes))
    policy.predicted["fixed_bytes"] = int(round(problem.fixed_bytes))
    policy.predicted["per_layer"] = [
        {"activation_bytes": int(round(problem.layer_memory(p, stash=options.chain_aware))),
         "time_s": problem.layer_time(p, chain_aware=options.chain_aware),
         "stage_bytes": [int(round(b)) for b in problem.stage_bytes(p, stash=options.chain_aware)],
         "forward_bytes": [int(round(b)) for b in problem.forward_stages(p, stash=options.chain_aware)]}
        for p in result.layer_picks]
    policy.op_costs = op_costs(profile, policy)
    return policy, result


def solve_stage(profile: LayerProfile, budget_bytes: float | None, options: SolveOptions, *, layers: int,
                in_flight: int, profile_ref: dict[str, Any] | None = None,
                signature: dict[str, Any] | None = None) -> tuple[Policy, SolveResult]:
    """One pipeline stage's policy: its ``layers`` layers, solved for the ``in_flight`` micro-batches it holds at
    once under 1F1B (:func:`~megatron_adacc.adacc.policy.static.in_flight`), whose activations sit side by side:
    the cost model's layers, ``in_flight`` times over. ``profile`` carries the stage's own static memory.

    The policy has the stage's ``layers`` layers; its prediction is the stage's peak (every micro-batch in flight:
    ``memory_bytes``, ``activation_bytes``) with ``per_layer`` for one micro-batch, as the runtime measures it, and
    ``in_flight``. Raises :class:`InfeasibleBudgetError` as :func:`solve_policy` does.
    """
    count = in_flight * layers
    # one layer policy repeated: a heterogeneous solve's layer counts need not split into ``in_flight`` copies
    options = replace(options, heterogeneous=options.heterogeneous and in_flight == 1)
    sig = dict(signature if signature is not None else profile.signature)
    policy, result = solve_policy(profile, budget_bytes, options, num_layers=count, profile_ref=profile_ref,
                                  signature={**sig, "num_layers": count})
    stage = policy.stage(0, layers)
    stage.signature = sig
    stage.predicted = {**policy.predicted, "per_layer": policy.predicted["per_layer"][:layers],
                       "in_flight": in_flight}
    return stage, result


def op_costs(profile: LayerProfile, policy: Policy) -> dict[str, dict[str, Any]]:
    """:attr:`Policy.op_costs` for ``policy`` from ``profile``: each op's bytes if kept, its recompute time, and,
    for each codec the policy uses on it, its compressed bytes and compress + decompress time (the profile's
    micro-benchmarks, as ``adacc profile`` prints them)."""
    used: dict[str, set[str]] = {}
    for layer in policy.layers:
        for op, d in zip(profile.ops, layer):
            if d.action == Action.COMPRESS:
                used.setdefault(op.name, set()).add(d.codec)
    return {op.name: {"saved_bytes": int(op.saved_bytes), "recompute_time_s": float(op.forward_time_s),
                      "codecs": {c: {"compressed_bytes": int(op.codecs[c].compressed_bytes),
                                     "time_s": float(op.codecs[c].compress_time_s + op.codecs[c].decompress_time_s)}
                                 for c in sorted(used.get(op.name, ())) if c in op.codecs}}
            for op in profile.ops}


def evaluate_policy(profile: LayerProfile, policy: Policy, *, chain_aware: bool = True) -> dict[str, float]:
    """Predicted memory and time of any policy (a preset, a peer) under a profile's cost model."""
    tiles = {check_tiles(dict(zip(OP_NAMES, layer))) for layer in policy.layers}
    if len(tiles) > 1:
        raise ValueError("the cost model evaluates policies whose layers re-run their MLP alike; this one tiles "
                         f"some layers' and not others' ({sorted(tiles)} tiles)")
    problem = tile_mlp(build_problem(profile, None, codecs="all", num_layers=policy.num_layers), tiles.pop(),
                       mlp_weight_bytes(profile.signature))
    picks = []
    for layer in policy.layers:
        row = []
        for i, d in enumerate(layer):
            idx = next((k for k, c in enumerate(problem.choices[i]) if c.decision.action == d.action
                        and c.decision.codec == d.codec and c.decision.tiles == d.tiles), None)
            if idx is None:
                raise ValueError(f"op {problem.op_names[i]!r}: {d.label} was not profiled; re-run adacc profile")
            row.append(idx)
        picks.append(row)
    stored, transient = problem.stored_and_transient(picks, stash=chain_aware)
    memory = problem.fixed_bytes + stored + transient
    return {"memory_bytes": memory, "static_bytes": problem.static_bytes,
            "workspace_bytes": problem.workspace_bytes, "activation_bytes": memory - problem.fixed_bytes,
            "transient_bytes": transient, "time_s": problem.total_time(picks, chain_aware=chain_aware)}


def evaluate_stage(profile: LayerProfile, policy: Policy, in_flight: int, *, chain_aware: bool = True
                   ) -> dict[str, float]:
    """:func:`evaluate_policy` of one pipeline stage's ``policy`` with its ``in_flight`` micro-batches' activations
    held side by side (as :func:`solve_stage` solves for them); ``time_s`` covers every one of them."""
    return evaluate_policy(profile, replace(policy, layers=policy.layers * in_flight), chain_aware=chain_aware)
