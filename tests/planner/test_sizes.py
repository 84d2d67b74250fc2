"""Per-op saved bytes without allocating (issue 21, item 4): megatron-core's layer on fake tensors through the
runtime's decomposition. On CPU models the planner's sizes equal what the runtime measures; at full size they
equal Korthikanti et al. 2022's per-layer activation memory (``sbh(34 + 5as/h)`` bytes in 16 bits, with their
tensor- and sequence-parallel divisions) up to the terms where ours differs by construction, stated one by one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_adacc.adacc.planner.layout import Layout
from megatron_adacc.adacc.planner.sizing import FakeModel, fake_tensors
from megatron_adacc.adacc.policy.ops import OP_NAMES
from megatron_adacc.adacc.policy.policy import Policy
from megatron_adacc.testing import init_distributed_single, memory_cap, tiny_config


@pytest.fixture(scope="module", autouse=True)
def _world():
    init_distributed_single()


def layer_bytes(sizes) -> int:
    """What one layer holds for backward with every op kept: every op's saved storages (``layer_input``'s is the
    layer's input)."""
    return sum(op.saved_bytes for op in sizes.ops.values())


def fake_sizes(args, config, layout=None, target="cpu", micro_batch=None):
    with fake_tensors(target):
        return FakeModel(args, config, layout or Layout(), target).sizes(micro_batch or args.micro_batch_size)[0]


# ------------------------------------------------------------------------------------- CPU models: equal
MIXED = {"linear_qkv": "int4_channelwise", "scores": "int4_asymmetric", "softmax": "recompute",
         "dropout": "recompute", "linear_fc1": "int4_symmetric", "activation": "recompute",
         "pre_mlp_layernorm": "stochastic"}
POLICIES = {
    "keep": Policy.all_keep(1),
    "recompute": Policy.all_recompute(1),
    "selective": Policy.uniform(dict.fromkeys(("scores", "softmax", "dropout", "context"), "recompute"), 1),
    "quantize-all": Policy.quantize_all(1),
    "mixed": Policy.uniform(MIXED, 1),
}


@pytest.mark.parametrize("config_name", ["tiny", "llama-tiny"])
def test_planner_sizes_equal_what_the_runtime_measures(config_name) -> None:
    """The fake run's per-op sizes predict, for every policy, exactly the bytes the runtime then holds running the
    real layer on real data (no data-dependent codec: the outlier codec's share of exact channels is assumed)."""
    from megatron_adacc.adacc.integration.sample import layer_sample
    from megatron_adacc.adacc.runtime import accounting, predict_layer_memory, profile_layer_sizes
    from megatron_adacc.adacc.runtime.checkpoint import checkpointed_layer_forward
    from megatron_adacc.training import model as model_lib
    from megatron_adacc.training.args import parse_train_args

    args = parse_train_args(["--config", config_name, "--device", "cpu", "--seq-length", "32",
                             "--micro-batch-size", "2"])
    config = model_lib.transformer_config(args, torch.device("cpu"))
    with memory_cap(6):
        sizes = fake_sizes(args, config)
        real = layer_sample(args, config, torch.device("cpu"))
        x = real.hidden.detach().requires_grad_(True)  # a layer's input wants its gradient in training
        measured_sizes = profile_layer_sizes(real.layer, x, real.mask, real.rope)
        for name in OP_NAMES:
            ours, theirs = sizes.ops[name], measured_sizes.ops[name]
            assert (ours.saved_bytes, ours.saved_count, ours.output_bytes, ours.stash_keep_bytes, ours.grad_bytes,
                    ours.consumer_bytes, ours.freed_bytes) == (
                theirs.saved_bytes, theirs.saved_count, theirs.output_bytes, theirs.stash_keep_bytes,
                theirs.grad_bytes, theirs.consumer_bytes, theirs.freed_bytes), name
        for label, policy in POLICIES.items():
            decisions = policy.layer_decisions(0)
            accounting.clear()
            checkpointed_layer_forward(real.layer, decisions, x, real.mask, real.rope, layer_index=0)
            measured = accounting.latest()[0]
            predicted = predict_layer_memory(decisions, sizes)
            assert (measured.per_op, measured.stash_bytes, measured.rng_bytes, measured.input_bytes) == (
                predicted.per_op, predicted.stash_bytes, predicted.rng_bytes, predicted.input_bytes), label


@pytest.mark.parametrize("attention", ["unfused", "sdpa"])
def test_the_cost_model_stores_what_the_runtime_holds_for_every_policy(attention) -> None:
    """The solver's stored bytes of a layer policy (``Problem.layer_memory`` with segment stashes, from the profile
    the planner makes of these sizes) equal the runtime's prediction from the same sizes, for every codec and
    random policies, the attention's reads past the ops between included (under SDPA, ``context`` reads q, k and
    v: a segment holding it holds them, stored compressed), and a segment that never re-runs holds nothing."""
    import random

    from megatron_adacc.adacc.planner.profile import planned_profile
    from megatron_adacc.adacc.policy.cost_model import build_problem
    from megatron_adacc.adacc.policy.signature import model_signature
    from megatron_adacc.adacc.runtime import predict_layer_memory
    from megatron_adacc.core.gpus import GPUS
    from megatron_adacc.training import model as model_lib
    from megatron_adacc.training.args import parse_train_args

    flags = ["--attention-backend", "flash", "--attention-dropout", "0"] if attention == "sdpa" else []
    args = parse_train_args(["--config", "tiny", "--device", "cpu", "--seq-length", "32", "--micro-batch-size", "2",
                             *flags])
    config = model_lib.transformer_config(args, torch.device("cpu"))
    with memory_cap(6), fake_tensors("cpu"):
        model = FakeModel(args, config, Layout(), "cpu")
        sizes = model.sizes(2)[0]
        profile = planned_profile(model, 2, next(iter(GPUS.values())), model_signature(config, args), timed=False)
    problem = build_problem(profile, None, codecs="all")
    rng = random.Random(0)
    checked = crossing = 0
    while checked < 1000:
        picks = [rng.randrange(len(cs)) for cs in problem.choices]
        if problem.choices[0][picks[0]].is_recompute or problem.splits_a_read(picks):
            continue
        decisions = dict(zip(OP_NAMES, problem.decisions(picks)))
        predicted = predict_layer_memory(decisions, sizes)
        assert problem.layer_memory(picks, stash=True) == predicted.total_bytes - predicted.input_bytes, (
            [d.label for d in decisions.values()])
        checked += 1
        crossing += decisions["context"].action == "recompute" and decisions["linear_qkv"].action != "recompute" and (
            any(decisions[n].action != "recompute" for n in ("scores", "softmax", "dropout")))
    assert crossing > 50  # the read past the ops between was exercised


# ------------------------------------------------------------------------------ full size: the formula
def gpt(hidden: int, heads: int, layers: int, seq: int, micro_batch: int, **overrides):
    """A GPT of the paper's family in bf16 (megatron-core's local layer, unfused attention, dropout on)."""
    args = SimpleNamespace(seq_length=seq, micro_batch_size=micro_batch, position_embedding_type="learned_absolute",
                           attention_backend=None, adacc_outlier_z=None)
    config = tiny_config(hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
                         num_layers=layers, bf16=True, params_dtype=torch.bfloat16, **overrides)
    return args, config


GPT_345M = dict(hidden=1024, heads=16, layers=24, seq=1024, micro_batch=8)
GPT_4_7B = dict(hidden=3072, heads=24, layers=40, seq=1024, micro_batch=1)


def korthikanti(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """Per-layer activation bytes in 16 bits (Korthikanti et al. 2022, eq. 1-3 and section 4.2.2)."""
    if sp:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize("shape", [GPT_345M, GPT_4_7B], ids=["gpt-345m", "gpt-4.7b"])
@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (2, True), (4, True)],
                         ids=["no-parallelism", "tp2", "tp2-sp", "tp4-sp"])
def test_full_size_layers_match_the_published_activation_memory(shape, t, sp) -> None:
    """On a GPU's kernels (dropout masks of one byte, 16-bit attention probabilities from the fused softmax), the
    only term the paper leaves out is the two LayerNorms' per-token statistics (mean and rstd, 2 bytes each on
    the CPU kernel the fake run takes): 8 bytes a token, on the tokens each rank holds."""
    args, config = gpt(**shape)
    s, b, h, a = shape["seq"], shape["micro_batch"], shape["hidden"], shape["heads"]
    sizes = fake_sizes(args, config, Layout(tensor=t, sequence_parallel=sp), "cuda")
    tokens = s * b / (t if sp else 1)
    assert layer_bytes(sizes) == korthikanti(s, b, h, a, t, sp) + 8 * tokens
    assert abs(layer_bytes(sizes) / korthikanti(s, b, h, a, t, sp) - 1) < 0.02


def test_cpu_kernels_differ_from_the_formula_term_by_term() -> None:
    """On the CPU's kernels (what `adacc train` measures here) four terms differ from the paper's GPU ones."""
    args, config = gpt(**GPT_345M)
    s, b, h, a = 1024, 8, 1024, 16
    sizes = fake_sizes(args, config, target="cpu")
    fp32_softmax = 2 * a * s * s * b          # attention_softmax_in_fp32: probabilities kept in 4 bytes, not 2
    attention_mask = a * s * s * b            # dropout keeps its 16-bit multiplier, not a 1-byte mask
    hidden_masks = 2 * s * b * h              # the two hidden dropouts, likewise
    norm_stats = 8 * s * b                    # the two LayerNorms' mean and rstd
    assert layer_bytes(sizes) == korthikanti(s, b, h, a) + fp32_softmax + attention_mask + hidden_masks + norm_stats


def llama_7b(groups: int):
    """A 7B Llama-style model (RMSNorm, SwiGLU, RoPE, no bias, SDPA) at 4096 tokens, with ``groups`` key/value
    groups for its 32 heads."""
    args = SimpleNamespace(seq_length=4096, micro_batch_size=1, position_embedding_type="rope",
                           attention_backend="flash", adacc_outlier_z=None)
    config = tiny_config(hidden_size=4096, num_attention_heads=32, num_query_groups=groups, ffn_hidden_size=14336,
                         num_layers=32, bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                         attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
                         activation_func=torch.nn.functional.silu, add_bias_linear=False)
    return args, config


def test_a_7b_llama_style_layer_is_sized_without_allocating() -> None:
    """Sizing the layer allocates neither its parameters (0.4 GB in bf16) nor its activations (over 1 GB), and
    grouped-query attention holds less than multi-head attention of the same width."""
    from megatron_adacc.core.devices import resident_bytes

    before = resident_bytes()
    grouped = fake_sizes(*llama_7b(8), target="cuda")
    assert resident_bytes() - before < 256 * 2**20
    assert grouped.input_bytes == 2 * 4096 * 4096  # the bf16 residual stream
    assert layer_bytes(grouped) > 10**9  # what its ops save; RMSNorm saves an fp32 copy, not the input
    assert layer_bytes(grouped) < layer_bytes(fake_sizes(*llama_7b(32), target="cuda"))
