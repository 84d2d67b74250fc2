"""The Adacc paper's setups planned on V100s without one: `adacc plan`'s predictions beside the paper's figures.

* Table 3: each method's largest micro-batch on a V100-32GB (8 GPUs, data parallel, ZeRO as Megatron's distributed
  optimizer, fp16: a V100 has no bf16) for GPT-117M, GPT-345M and GPT-4.7B (configs/gpt-*.toml).
* Section 1: Megatron's full recompute's share of the step time, GPT-345M at micro-batch 8 on 4 V100s (the paper:
  "over 28%").
* Fig. 5 / section 4.2: Adacc's speed-up over full recompute across micro-batches (the paper: 1.01-1.37x).

Each setup is one `adacc plan` run in its own process (the command users run). Writes ``results/plan.json`` and the
table ``benchmarks/PLAN.md``. Every time is a prediction (a roofline of every kernel on the V100's datasheet peaks).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_adacc.bench import harness
from megatron_adacc.core.log import Steps, echo
from megatron_adacc.core.tables import format_table

#: Table 3 of the paper (seed 000): the largest batch each method fits.
PAPER_TABLE3 = {
    "gpt-117m": {"megatron_none": 57, "megatron_full": 136, "quantization": 98, "adacc": 136},
    "gpt-345m": {"megatron_none": 8, "megatron_full": 61, "quantization": 19, "adacc": 61},
    "gpt-4.7b": {"megatron_none": 1, "megatron_full": 4, "quantization": 3, "adacc": 4},
}
#: Section 1: "full recomputation accounts for over 28% of the total training time" (GPT-345M, batch 8, 4 V100s).
PAPER_RECOMPUTE_SHARE = 0.28
#: Section 4.2: "Adacc improves the throughput by 1.01x - 1.37x ... compared to Full Recomputation".
PAPER_SPEEDUP = (1.01, 1.37)
#: The micro-batches of each model's Fig. 5 sweep (the paper's x axes go up to the largest batch that fits).
SWEEPS = {"gpt-117m": (1, 2, 4, 8, 16, 32, 64, 128), "gpt-345m": (1, 2, 4, 8, 15, 16, 32, 61),
          "gpt-4.7b": (1, 2, 3, 4)}
TABLE3_METHODS = ("megatron_none", "megatron_full", "quantization", "adacc")
V100 = ["--fp16", "--device", "v100-32gb", "--use-distributed-optimizer"]


def add_arguments(parser) -> None:
    parser.add_argument("--models", nargs="+", default=None, choices=tuple(PAPER_TABLE3),
                        help="Which of the paper's models (default all three; gpt-345m with --quick).")


def plan(config: str, micro_batch: int, data: int, extra: list[str]) -> dict:
    """One `adacc plan` run in its own process: its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "megatron_adacc.cli", "-q", "plan", "--config", config, *V100,
               "--data-parallel-size", str(data), "--micro-batch-size", str(micro_batch), "--output-json", str(out),
               *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"adacc plan failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def speedups(sweep: dict) -> list[float]:
    """Full recompute's predicted step time over Adacc's, at each micro-batch where both fit."""
    return [t["megatron_full"] / t["adacc"] for t in sweep.values() if t["megatron_full"] and t["adacc"]]


def run(args) -> dict:
    models = args.models or (["gpt-345m"] if args.quick else list(PAPER_TABLE3))
    results: dict = {}
    with Steps(len(models) + 1, "plan") as step:
        step("gpt-345m, micro-batch 8 on 4 V100s")
        motivating = plan("gpt-345m", 8, 4, ["--no-search"])
        for model in models:
            step(f"{model} on 8 V100s")
            sweep = [] if args.quick else ["--sweep", *map(str, SWEEPS[model])]
            results[model] = plan(model, 1, 8, sweep)
    table = render(results, motivating)
    echo(table)
    methods = {model: {"largest_micro_batch": {m: r["methods"][m]["largest_micro_batch"] for m in TABLE3_METHODS},
                       "speedup_over_full": speedups(r["sweep"])} for model, r in results.items()}
    harness.write_results("plan", {"models": models, "gpu": "v100-32gb", "data_parallel": 8, "quick": args.quick},
                          methods, extra={"recompute_share_gpt345m_b8_dp4": motivating["recompute_share"],
                                          "plans": results}, args=args)
    target = harness.results_dir(args) / "PLAN.md" if args.quick else harness.REPO_ROOT / "benchmarks" / "PLAN.md"
    target.write_text(table + "\n")
    return methods


def render(results: dict, motivating: dict) -> str:
    """The table of benchmarks/PLAN.md: predictions beside the paper, one row per figure."""
    rows = []
    for model, r in results.items():
        for m in TABLE3_METHODS:
            ours = r["methods"][m]["largest_micro_batch"]
            rows.append([f"Table 3, {model}", m, str(PAPER_TABLE3[model][m]), str(ours) if ours else "none"])
        ups = speedups(r["sweep"])
        if ups:
            rows.append([f"Fig. 5, {model}", "adacc / full", f"{PAPER_SPEEDUP[0]:.2f}-{PAPER_SPEEDUP[1]:.2f}x",
                         f"{min(ups):.2f}-{max(ups):.2f}x"])
    share = motivating["recompute_share"]
    rows.append(["Sec. 1, gpt-345m b=8, 4 GPUs", "full recompute share", f"> {PAPER_RECOMPUTE_SHARE:.0%}",
                 f"{share:.0%}"])
    head = ("# The Adacc paper's setups, planned\n\n`adacc bench plan` (every `ours` figure is `adacc plan`'s "
            "prediction for a V100-SXM2-32GB: fp16, data parallel with Megatron's distributed optimizer as the "
            "paper's ZeRO, 90% of the memory as the budget; times from a roofline). The reading is in "
            "benchmarks/README.md.\n\n")
    return head + "```\n" + format_table(["figure", "method", "paper", "ours (predicted)"], rows) + "\n```"
