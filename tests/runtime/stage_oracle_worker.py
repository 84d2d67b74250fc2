"""Measures, in a process of its own, the per-stage backward peaks of one profiled layer under several policies,
beside the cost model's bound for each stage (for test_backward_stages.py). The process must run with
MALLOC_MMAP_THRESHOLD_=65536 from its start: otherwise glibc serves large tensors from heap memory freed
earlier (by the profiler) and the resident size stops following them. Prints one JSON line."""

from __future__ import annotations

import json

import torch
from megatron.core.tensor_parallel.random import _fork_rng

from megatron_adacc.adacc.integration.profiler import profile_layer
from megatron_adacc.adacc.integration.sample import layer_sample
from megatron_adacc.adacc.policy.cost_model import tile_mlp
from megatron_adacc.adacc.policy.ops import OP_NAMES, TILED_OPS
from megatron_adacc.adacc.policy.policy import Decision, Policy, check_tiles
from megatron_adacc.adacc.policy.profile import mlp_weight_bytes
from megatron_adacc.adacc.policy.solver import SolveOptions, make_problem
from megatron_adacc.adacc.runtime import checkpointed_layer_forward, stages
from megatron_adacc.training import distributed
from megatron_adacc.training import model as model_lib
from megatron_adacc.training.args import parse_train_args

ARGV = ["--config", "tiny", "--device", "cpu", "--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size",
        "1024", "--num-attention-heads", "4", "--seq-length", "256", "--micro-batch-size", "4"]


def _mixed() -> dict[str, Decision]:
    """The MLP recomputed, the attention compressed: transients the old bound added up."""
    out = {name: Decision.keep() for name in OP_NAMES}
    out.update(linear_fc1=Decision.recompute(), activation=Decision.recompute(),
               softmax=Decision.compress("int4_asymmetric"), dropout=Decision.compress("int4_asymmetric"),
               context=Decision.compress("int4_outlier", z_threshold=3.0))
    return out


def _split_read() -> dict[str, Decision]:
    """Two recompute segments, the attention's and the MLP's, split at the kept pre-MLP norm: the MLP's residual
    add reads the attention's output, which the first segment recomputes, so that segment re-runs with the MLP's
    at the start of the layer's backward (the solvers leave such policies out; a policy file may have one)."""
    out = {name: Decision.recompute() for name in OP_NAMES}
    out.update(layer_input=Decision.keep(), pre_mlp_layernorm=Decision.keep())
    return out


def _tiled() -> dict[str, Decision]:
    """Below full recompute with the MLP re-run in 4 token tiles: the layer input and the MLP's norm compressed
    (so the attention re-runs after the MLP's backward, not beside it), the rest recomputed."""
    out = {name: Decision.recompute() for name in OP_NAMES}
    outlier = Decision.compress("int4_outlier", z_threshold=3.0)
    out.update(layer_input=outlier, pre_mlp_layernorm=outlier, mlp_bda=outlier,
               **{name: Decision.recompute(4) for name in TILED_OPS})
    return out


POLICIES = {
    "keep": Policy.all_keep(1).layer_decisions(0),
    "recompute": Policy.preset("all-recompute", 1).layer_decisions(0),
    "quantize": Policy.quantize_all(1).layer_decisions(0),
    "mixed": _mixed(),
    "split_read": _split_read(),
    "tiled": _tiled(),
}


def measured(sample, decisions) -> dict[str, int]:
    # parameter gradients exist before backward, as in training (Megatron's gradient buffers, counted in the
    # static memory): a first backward allocating them would grow every later stage by them
    for param in sample.layer.parameters():
        param.grad = torch.zeros_like(param)
    with _fork_rng(), stages.BackwardTrace() as trace:
        # the layer's input is made inside the graph, as a layer's is in training (a leaf would be held by its
        # gradient accumulator, and a local by this frame, a compressed input included)
        x = layer_input(sample.hidden.detach().requires_grad_(True))
        out = checkpointed_layer_forward(sample.layer, decisions, x, sample.mask, sample.rope, layer_index=0)
        del x
        out.backward(torch.ones_like(out))
        del out
    return {s.label: s.peak_bytes for s in trace.stages if s.label[:3] in ("L0/", "F0/")}


def layer_input(leaf: torch.Tensor) -> torch.Tensor:
    """A copy of ``leaf`` that its graph does not hold (the copy's backward saves nothing)."""
    return leaf.clone()


def predicted(problem, decisions, signature) -> tuple[list[float], float]:
    """The bound of each backward stage, and of the forward: its largest forward stage (what the ops before the op
    stored, the outputs still read and the op's own forward), which the last layer of a model has beside the
    others' stored bytes."""
    problem = tile_mlp(problem, check_tiles(decisions), mlp_weight_bytes(signature))
    picks = [next(k for k, c in enumerate(cs) if c.decision == decisions[name])
             for name, cs in zip(OP_NAMES, problem.choices)]
    return problem.stage_bytes(picks, stash=True), max(problem.forward_stages(picks, stash=True))


def main() -> None:
    torch.set_num_threads(1)
    args = parse_train_args(ARGV)
    device = torch.device("cpu")
    distributed.initialize(device, args.seed)
    config = model_lib.transformer_config(args, device)
    sample = layer_sample(args, config, device)
    profile = profile_layer(sample, args, config, device=device, repeats=1)
    problem = make_problem(profile, None, SolveOptions(codecs="all"), num_layers=1)
    out = {}
    for name, decisions in POLICIES.items():
        measured(sample, decisions)  # warm-up: the first run's first-touch allocations are not the layer's
        # the least of three runs per stage: what the allocator's small blocks add varies from run to run
        runs = [measured(sample, decisions) for _ in range(3)]
        least = {label: min(run[label] for run in runs) for label in runs[0]}
        stages, forward = predicted(problem, decisions, profile.signature)
        out[name] = {"measured": {label[3:]: v for label, v in least.items() if label.startswith("L0/")},
                     "predicted": stages,
                     "forward": max(v for label, v in least.items() if label.startswith("F0/")),
                     "forward_bound": forward}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
