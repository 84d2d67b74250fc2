"""``adacc plan`` (issue 21, item 5): every method's per-GPU memory on the solver's cost model, Megatron's modes
equal to what Megatron's own forward holds, pipeline stages with their micro-batches in flight, the largest
micro-batch search, and the command line with its refusals."""

from __future__ import annotations

import copy
import json

import pytest

from megatron_adacc.adacc.planner.layout import Layout
from megatron_adacc.adacc.planner.plan import METHODS_BY_NAME, Planner, make_plan
from megatron_adacc.adacc.policy.ops import OPS_BY_NAME
from megatron_adacc.core.gpus import GPUS
from megatron_adacc.testing import memory_cap


def _held_by_megatron(mode: str, batch) -> int:
    """The bytes megatron-core's own decoder holds for backward under its recompute ``mode`` (the final norm's,
    which no layer policy changes, left out), measured on the real tiny model."""
    from megatron_adacc.core.saved import SavedTensorMeter
    from megatron_adacc.testing import build_tiny_gpt

    def held(run) -> int:
        """What the graph ``run()`` builds keeps: a checkpoint's forward runs without grad, where the CPU's
        in-place dropout still calls the pack hook for a mask nothing keeps (it dies as the forward goes on)."""
        with SavedTensorMeter(params) as meter:
            output = run()
        alive = sum(entry.nbytes for entry in meter.storages.values() if entry.ref() is not None)
        del output
        return alive

    recompute = {"none": {}, "selective": {"recompute_granularity": "selective"},
                 "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}
    model = build_tiny_gpt(seq_length=32, hidden_size=64, ffn_hidden_size=256, num_layers=2, **recompute[mode])
    model.train()
    tokens, positions, mask, _ = batch
    hidden = model.embedding(input_ids=tokens, position_ids=positions).detach().requires_grad_(True)
    params = list(model.parameters())
    everything = held(lambda: model.decoder(hidden_states=hidden, attention_mask=mask))
    return everything - held(lambda: model.decoder.final_layernorm(hidden)) - mask.untyped_storage().nbytes()


def test_megatrons_modes_hold_what_megatron_holds(tiny2) -> None:
    """Megatron's modes are the policies that hold what megatron-core holds: ``none`` exactly; the recomputing modes
    up to each checkpoint's RNG states, which Megatron keeps on its autograd context, where no saved-tensor meter sees
    them (on the CPU they are memory; a GPU's are host tensors, 0 in a GPU plan). Selective recompute also saves its
    attention mask type as a 4-byte tensor; full recompute's policy keeps the first op's output while eq. 6 makes it
    the checkpoint (until the layer input itself may be)."""
    from megatron_adacc.testing import tiny_batch

    args, config = tiny2
    batch = tiny_batch(batch_size=2, seq_length=32)
    with memory_cap(6), Planner(args, config, Layout(), GPUS["a100-80gb"], target="cpu") as planner:
        plan = planner.plan(2)
        held = {m: plan.methods[f"megatron_{m}"].worst.held_bytes for m in ("none", "selective", "full")}
        ln1 = planner.profile(2).op("input_layernorm").saved_bytes
        rng = 2 * planner.profile(2).rng_bytes  # one checkpoint with dropout per layer
        measured = {m: _held_by_megatron(m, batch) for m in held}
    assert rng > 0
    assert held["none"] == measured["none"]
    assert held["selective"] == measured["selective"] + rng - 2 * 4
    eq6 = 0 if OPS_BY_NAME["input_layernorm"].recomputable else 2 * ln1
    assert held["full"] == measured["full"] + rng + eq6


def test_pipeline_stages_hold_their_micro_batches_in_flight(tiny2) -> None:
    """Stage 0 of two holds two micro-batches of its two layers: what four layers of one micro-batch hold without
    pipelining; the last stage holds one, plus the logits, and the model states are split between them."""
    args, config = tiny2
    four = copy.copy(config)
    four.num_layers = 4
    with memory_cap(6):
        with Planner(args, four, Layout(), GPUS["a100-80gb"], target="cpu") as planner:
            whole = planner.plan(2).methods["megatron_none"].worst
        with Planner(args, four, Layout(pipeline=2), GPUS["a100-80gb"], target="cpu") as planner:
            first, last = planner.plan(2).methods["megatron_none"].stages
    assert (first.in_flight, last.in_flight, first.layers) == (2, 1, 2)
    assert first.held_bytes == whole.held_bytes and 2 * last.held_bytes == whole.held_bytes
    assert first.static.workspace_bytes == 0 and last.static.workspace_bytes == whole.static.workspace_bytes
    assert first.static.parameters + last.static.parameters == whole.static.parameters + 256 * 64  # tied copy


def test_the_largest_micro_batch_is_the_last_that_fits(tiny2) -> None:
    """On a GPU too small for much: each method's largest micro-batch fits and the next does not, and the methods
    come in the order of what they hold (Adacc, which may also compress, never below full recompute)."""
    args, config = tiny2
    with memory_cap(6), Planner(args, config, Layout(), GPUS["a100-80gb"], 64 * 2**20, target="cpu") as planner:
        plan = make_plan(planner, 2)
        for name, b in plan.largest.items():
            method = METHODS_BY_NAME[name]
            assert b >= 1 and planner.fits(method, b) and not planner.fits(method, b + 1), name
    largest = plan.largest
    assert largest["megatron_none"] <= largest["megatron_selective"] <= largest["megatron_full"] <= largest["adacc"]


def run_plan(argv, capsys):
    from megatron_adacc.cli import main

    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


PLAN = ["--config", "tiny", "--num-layers", "2", "--seq-length", "64", "--micro-batch-size", "4"]


def test_adacc_plan_prints_the_breakdown_searches_and_labels_predictions(capsys, tmp_path) -> None:
    with memory_cap(6):
        code, out, _ = run_plan([*PLAN, "--device", "v100-32gb", "--fp16", "--data-parallel-size", "2",
                                 "--use-distributed-optimizer", "--device-memory", "256MiB", "--sweep", "1", "2",
                                 "--output-json", str(tmp_path / "plan.json")], capsys)
    assert code == 0
    for part in ("parameters", "optimizer states", "activations held", "logits workspace", "largest micro-batch",
                 "step time (predicted)", "Times are predictions", "Adacc's policy", "V100-SXM2-32GB"):
        assert part in out, part
    assert max(len(line) for line in out.splitlines()) <= 100
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["layout"]["data"] == 2 and written["signature"]["dtype"] == "float16"
    assert written["signature"]["vocab_size"] == 50304  # GPT-2's 50257, padded to a multiple of 128
    assert set(written["sweep"]) == {"1", "2"} and written["methods"]["adacc"]["largest_micro_batch"] >= 1


@pytest.mark.parametrize("argv,words", [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide --num-attention-heads"),
    (["--pipeline-model-parallel-size", "3"], "does not divide --num-layers"),
    (["--sequence-parallel"], "--sequence-parallel splits the sequence over tensor-parallel ranks"),
    (["--bf16", "--device", "v100-32gb"], "has no bf16 arithmetic; plan with --fp16"),
    (["--device-memory", "4MiB", "--no-search"], "nothing fits"),
    (["--device-memory", "4MiB"], "nothing fits"),
])
def test_an_impossible_plan_is_one_line(argv, words, capsys) -> None:
    with memory_cap(6):
        code, out, err = run_plan([*PLAN, *argv], capsys)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_benchmark_table_puts_predictions_beside_the_papers_figures() -> None:
    """`adacc bench plan` renders every figure it compares: Table 3's largest batches, Fig. 5's speed-up range
    over the micro-batches where both methods fit, and the motivating recompute share."""
    from megatron_adacc.bench.plan import PAPER_TABLE3, TABLE3_METHODS, render, speedups

    result = {"methods": {m: {"largest_micro_batch": b} for m, b in zip(TABLE3_METHODS, (8, 55, 25, 59))},
              "sweep": {"8": {"megatron_full": 0.5, "adacc": 0.4}, "32": {"megatron_full": 2.0, "adacc": 1.6},
                        "64": {"megatron_full": None, "adacc": 3.0}}}
    assert speedups(result["sweep"]) == [1.25, 1.25]
    table = render({"gpt-345m": result}, {"recompute_share": 0.2449})
    assert "Table 3, gpt-345m" in table and str(PAPER_TABLE3["gpt-345m"]["megatron_full"]) in table
    assert "1.25-1.25x" in table and "24%" in table and "> 28%" in table
