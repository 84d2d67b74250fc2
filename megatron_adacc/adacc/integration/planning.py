"""Where ``--adacc-policy auto`` plans: out of the training process, on the CPU.

On the CPU the budget is the training process's peak RSS. The planner's machinery is what a GPU run holds in
host memory, outside its budget: sqlite3 and the profile database, the cost model and the solver's strategies,
PuLP and its MILP backend, and the working memory of a solve. In the CPU's training process they counted against
llama-tiny's 35 MiB between no recompute and full recompute: PuLP and HiGHS 5.2 MiB, until the solves forked, and
the rest 2.35 MiB, until planning did (30-step runs keeping everything, 2026-12-07).

So a process that can fork and is its own world plans in a forked child (:func:`plan`): the child looks up or
makes the profile, calibrates, solves and prepares evolution, and the training process keeps only the answers,
the policy and what evolution re-solves from (:class:`~.evolution.EvolutionStart`), whose re-solves fork in turn
(:func:`isolated_solves`). Several ranks plan in the process, rank 0 for all (:func:`~.auto.on_rank0`), each
solve forked.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron_adacc.adacc.integration.evolution import EvolutionStart

#: What planning sets on the run's arguments, handed back from a forked planner: the process memory the policy was
#: solved against, which the run's report and a re-solve read from the arguments (``auto.process_baseline``).
SETTLED_ARGS = ("adacc_process_baseline_bytes", "adacc_codec_pages_bytes")


def run_device(args: Any) -> torch.device:
    """The device the run trains on (``--device``, default: CUDA where there is one)."""
    from megatron_adacc.core.devices import resolve_device

    return resolve_device(getattr(args, "device", "auto"))


def isolated_solves(device: torch.device) -> bool:
    """Whether the MILP runs in a forked child (:func:`~megatron_adacc.compat.process.forked`): on the CPU, where
    the budget is this process's peak RSS. PuLP, the backend it loads and their working memory (5.2 MiB resident
    on llama-tiny, a tenth of its activations) are what a GPU run holds in host memory, outside its budget; in
    the training process they would count in the CPU's, and grow with every re-solve of evolution.

    Not in a process that has loaded PuLP already (a notebook that solved before, a test session): it holds them
    anyway, and HiGHS's thread pool, started by its first solve, does not survive a fork (the child's solve
    waits forever for threads that are not there)."""
    return device.type == "cpu" and hasattr(os, "fork") and "pulp" not in sys.modules and not _in_planner


#: Set in the forked child that plans (:func:`plan`): its solves need no child of their own.
_in_planner = False


def plans_in_child(args: Any) -> bool:
    """Whether ``auto`` plans in a forked child: where its solves do (:func:`isolated_solves`), in a process
    that is its own world. Ranks of a larger one meet in collectives while planning (rank 0 profiles, calibrates
    and solves for all), which a forked child cannot join."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return isolated_solves(run_device(args)) and (not distributed or torch.distributed.get_world_size() == 1)


@dataclass
class Plan:
    """What ``--adacc-policy`` resolved to, and what the training process keeps of planning it."""

    policy: Any
    """None (``none``), a preset's name or policy, a file's policy, or the policy ``auto`` solved."""
    evolution: EvolutionStart | None = None
    """Where evolution starts (:class:`~.evolution.EvolutionStart`): a solved policy's, unless turned off."""
    settled: dict[str, Any] = field(default_factory=dict)
    """The arguments planning set (:data:`SETTLED_ARGS`)."""


def plan(args: Any, config: Any) -> Plan:
    """Resolve ``--adacc-policy`` for this run, and for ``auto`` prepare evolution; in a forked child where
    :func:`plans_in_child`, whose settled arguments are then set here as well."""
    auto = (getattr(args, "adacc_policy", "none") or "none").lower() == "auto"
    if not (auto and plans_in_child(args)):
        return _plan(args, config)
    from megatron_adacc.compat.process import forked

    answer = forked(lambda: _plan(args, config, in_child=True))
    for name, value in answer.settled.items():
        setattr(args, name, value)
    return answer


def _plan(args: Any, config: Any, *, in_child: bool = False) -> Plan:
    from megatron_adacc.adacc.integration.policy_source import resolve_policy
    from megatron_adacc.adacc.policy.policy import Policy

    global _in_planner
    _in_planner = in_child  # only ever set in the forked child, whose memory this is
    policy = resolve_policy(args, config, isolate=True)
    start = None
    if isinstance(policy, Policy) and policy.solved:  # only a solved policy names the profile it re-solves from
        from megatron_adacc.adacc.integration.evolution import evolution_start

        start = evolution_start(args, config, policy)
    settled = {name: getattr(args, name) for name in SETTLED_ARGS if getattr(args, name, None) is not None}
    return Plan(policy, start, settled)
