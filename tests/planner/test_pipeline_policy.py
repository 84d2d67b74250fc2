"""``--adacc-policy auto`` under pipeline parallelism (issue 21, item 2): every stage solved for its own layers, its
own model states and the micro-batches it holds in flight under 1F1B, in one policy of every layer from which each
stage installs its slice with its own prediction."""

from __future__ import annotations

import copy

import pytest

from megatron_adacc.adacc.integration.auto import solve_stages
from megatron_adacc.adacc.integration.checks import UnsupportedConfigError
from megatron_adacc.adacc.integration.model_states import charge_static, stage_layout
from megatron_adacc.adacc.integration.policy_source import check_layer_count
from megatron_adacc.adacc.planner.layout import Layout
from megatron_adacc.adacc.planner.plan import Planner
from megatron_adacc.adacc.policy import Policy, load_policy, save_policy
from megatron_adacc.adacc.policy.solver import SolveOptions, evaluate_stage, solve_stage
from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError
from megatron_adacc.core.gpus import GPUS
from megatron_adacc.testing import memory_cap

OPTIONS = SolveOptions(headroom=0.0)


@pytest.fixture(scope="module")
def pp2(tiny4):
    """The tiny model in 2 pipeline stages of 2 layers, 2 micro-batches per step, and its layer's profile."""
    args, config = tiny4
    args, config = copy.copy(args), copy.copy(config)
    args.global_batch_size = 2 * args.micro_batch_size
    config.pipeline_model_parallel_size = 2
    with memory_cap(6), Planner(args, tiny4[1], Layout(), GPUS["a100-80gb"], target="cpu") as planner:
        layer = planner.profile(args.micro_batch_size)
    return args, config, layer


def _peak(layer, args, config, stage: int, policy: Policy, held: int) -> float:
    return evaluate_stage(charge_static(layer, args, config, stage), policy, held)["memory_bytes"]


def test_each_stage_solves_its_own_layers_for_its_micro_batches_in_flight(pp2) -> None:
    """Stage 0 holds both micro-batches of a step, stage 1 one: under a budget where the last stage keeps
    everything, the first stage cannot, and each stage's slice and prediction are its own solve's."""
    args, config, layer = pp2
    assert [(layers, held) for _, layers, held in stage_layout(args, config)] == [(2, 2), (2, 1)]
    budget = _peak(layer, args, config, 1, Policy.all_keep(2), 1)
    policy = solve_stages(layer, {"db": None, "id": 1}, args, config, budget, OPTIONS, log=lambda _line: None)
    assert policy.num_layers == 4 and policy.signature["num_layers"] == 4
    assert [(s["first_layer"], s["num_layers"], s["in_flight"]) for s in policy.predicted["stages"]] == \
        [(0, 2, 2), (2, 2, 1)]
    first, last = policy.stage(0, 2), policy.stage(2, 2)
    assert last.same_decisions(Policy.all_keep(2)) and not first.same_decisions(Policy.all_keep(2))
    for stage, part in enumerate((first, last)):
        held = part.predicted["in_flight"]
        alone, _ = solve_stage(charge_static(layer, args, config, stage), budget, OPTIONS, layers=2, in_flight=held)
        assert part.same_decisions(alone)
        assert part.predicted == alone.predicted  # the stage's own peak, static memory and per-layer bytes
        assert part.predicted["memory_bytes"] == pytest.approx(_peak(layer, args, config, stage, part, held))
        assert part.predicted["memory_bytes"] <= budget
    # one micro-batch's bytes per layer, as the runtime measures them: every layer of the model, in order
    assert policy.predicted["per_layer"] == first.predicted["per_layer"] + last.predicted["per_layer"]
    assert policy.predicted["memory_bytes"] == max(first.predicted["memory_bytes"], last.predicted["memory_bytes"])


def test_a_stage_that_fits_nothing_refuses_with_the_largest_need(pp2) -> None:
    args, config, layer = pp2
    needs = []
    for stage, (_, layers, held) in enumerate(stage_layout(args, config)):
        with pytest.raises(InfeasibleBudgetError) as refused:
            solve_stage(charge_static(layer, args, config, stage), 1, OPTIONS, layers=layers, in_flight=held)
        needs.append(refused.value.min_feasible_bytes)
    with pytest.raises(InfeasibleBudgetError, match="pipeline stage 0") as refused:
        solve_stages(layer, {"db": None, "id": 1}, args, config, 1, OPTIONS, log=lambda _line: None)
    assert refused.value.min_feasible_bytes == max(needs) == needs[0]


def test_a_pipeline_policy_file_round_trips_with_its_stages(pp2, tmp_path) -> None:
    args, config, layer = pp2
    budget = _peak(layer, args, config, 1, Policy.all_keep(2), 1)
    policy = solve_stages(layer, {"db": None, "id": 1}, args, config, budget, OPTIONS, log=lambda _line: None)
    loaded = load_policy(save_policy(policy, tmp_path / "pp2.json"))
    for first in (0, 2):
        assert loaded.stage(first, 2).predicted == policy.stage(first, 2).predicted
        assert loaded.stage(first, 2).same_decisions(policy.stage(first, 2))
    assert Policy.all_keep(4).stage(2, 2).predicted == {}  # no stages: no prediction carries over


def test_a_policy_of_another_layer_count_is_refused_in_one_line(pp2) -> None:
    """A whole-model policy (each stage installs its slice) or one stage's (every stage installs it) runs;
    anything else is refused before the model is built."""
    _, config, _ = pp2
    for layers in (4, 2):
        assert check_layer_count(Policy.all_keep(layers), config, "p.json").num_layers == layers
    with pytest.raises(UnsupportedConfigError) as refused:
        check_layer_count(Policy.all_keep(3), config, "p.json")
    assert "\n" not in str(refused.value) and "has 3 layers but this model has 4 or one pipeline stage's 2" in \
        str(refused.value)
