"""Fig. 6 over several seeds: every method trained from the same seeds, read as paired differences.

One seed per method cannot resolve the paper's claims at this scale: the baseline trained from another seed
lands 0.3-1.2% away from itself (benchmarks/README.md), more than the 0.5% the paper bounds Adacc's loss by.
Training every method from the same seeds pairs the runs: the baseline and Adacc from one seed share their
initial weights, data order and dropout masks, so their difference is the method's, plus the divergence it
sets off. Its mean over seeds, with a 95% Student-t interval, is what the claims are held against; the
baseline's spread over seeds says how much pairing bought.

Validation batches are drawn from a fixed seed whatever ``--seed`` is (``training.loop``), so every run is
scored on the same text.
"""

from __future__ import annotations

import math
import statistics

#: Megatron's default seed first, so a one-seed run is the earlier single-seed recording.
SEEDS = (1234, 4321, 2718, 3141, 1618, 1414, 1732, 2236)
REFERENCE = "baseline"
#: The paper's bound on how much worse Adacc's loss may be than the baseline's, in percent.
PAPER_BOUND = 0.5
#: Two-sided 95% Student-t quantiles by degrees of freedom; 1.96 past the table.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def seeds(n: int) -> list[int]:
    """The first ``n`` seeds; refuses more than :data:`SEEDS` holds rather than invent ones nobody recorded."""
    if not 1 <= n <= len(SEEDS):
        raise ValueError(f"--loss-seeds {n}: choose 1 to {len(SEEDS)}")
    return list(SEEDS[:n])


def t975(df: int) -> float:
    return next((_T975[k] for k in sorted(_T975) if k >= df), 1.96)


def interval(diffs: list[float]) -> dict:
    """Mean, sample standard deviation and the 95% interval of the mean of ``diffs``; with one value the
    interval is unknown (None)."""
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"n": len(diffs), "mean": mean, "sd": None, "low": None, "high": None}
    sd = statistics.stdev(diffs)
    half = t975(len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return {"n": len(diffs), "mean": mean, "sd": sd, "low": mean - half, "high": mean + half}


def paired(runs: dict[str, dict[int, float]], a: str, b: str) -> list[float]:
    """Per seed both ``a`` and the reference ran: ``a`` minus ``b`` in percent of the reference's validation loss
    from that seed. ``runs`` maps method -> seed -> validation loss."""
    base = runs.get(REFERENCE, {})
    return [(runs[a][s] - runs[b][s]) / base[s] * 100 for s in sorted(runs.get(a, {}))
            if s in runs.get(b, {}) and base.get(s)]


def summary(runs: dict[str, dict[int, float]]) -> dict:
    """What the report reads: each method against the baseline, Quantization and the outlier ablation against
    Adacc (paired), and the baseline's own spread over seeds (its sample standard deviation in percent of its
    mean: what one unpaired comparison would be read against)."""
    out = {"vs_baseline": {m: interval(d) for m in runs if m != REFERENCE and (d := paired(runs, m, REFERENCE))}}
    for name, (a, b) in {"quantization_vs_adacc": ("quantization", "adacc"),
                         "no_outlier_vs_adacc": ("adacc_no_outlier", "adacc")}.items():
        if d := paired(runs, a, b):
            out[name] = interval(d)
    base = list(runs.get(REFERENCE, {}).values())
    if len(base) >= 2:
        out["baseline_spread_pct"] = statistics.stdev(base) / statistics.fmean(base) * 100
    return out


def table(runs: dict[str, dict[int, float]], stats: dict) -> list[str]:
    """Markdown rows: each method's validation loss per seed and its paired difference to the baseline."""
    order = list(dict.fromkeys(s for r in runs.values() for s in r))  # the order they ran in
    lines = ["| method | " + " | ".join(f"seed {s}" for s in order) + " | vs baseline, mean (95% interval) |",
             "|---|" + "---|" * len(order) + "---|"]
    for name, by_seed in runs.items():
        cells = [f"{by_seed[s]:.4f}" if s in by_seed else "-" for s in order]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_fmt(stats['vs_baseline'].get(name))} |")
    return lines


def _fmt(iv: dict | None) -> str:
    if not iv:
        return "-"
    if iv["low"] is None:
        return f"{iv['mean']:+.2f}% (one seed)"
    return f"{iv['mean']:+.2f}% ({iv['low']:+.2f} to {iv['high']:+.2f})"


def reading(stats: dict, decisions: dict | None = None) -> str:
    """The paper's three claims in words, each against its interval: Adacc within 0.5% of the baseline,
    Quantization worse than Adacc, outlier separation worth something."""
    parts = []
    spread = stats.get("baseline_spread_pct")
    if spread is not None:
        parts.append(f"the baseline's validation loss varies by {spread:.2f}% (sample standard deviation) from "
                     "seed to seed; the differences below are paired by seed (the same initial weights, data order "
                     "and dropout masks on both sides)")
    adacc = stats["vs_baseline"].get("adacc")
    if adacc and adacc["sd"] is not None and spread:
        parts.append(_pairing(adacc["sd"], spread))
    if adacc:
        parts.append(f"Adacc {_fmt(adacc)} against the baseline: " + _against_bound(adacc))
    quant = stats.get("quantization_vs_adacc")
    if quant:
        parts.append(f"Quantization {_fmt(quant)} against Adacc: " + _sign(quant, "worse", "better"))
    ablation = stats.get("no_outlier_vs_adacc")
    if ablation:
        if decisions is not None and not any("int4_outlier" in label for label in decisions):
            parts.append("Adacc's policy at this budget compresses no tensor with outlier separation, so the "
                         f"ablation measures nothing here ({_fmt(ablation)})")
        else:
            parts.append(f"without outlier separation {_fmt(ablation)} against Adacc: "
                         + _sign(ablation, "worse, so separation pays", "better"))
    return ("; ".join(parts) + ".") if parts else "no seeded runs to compare."


#: The interval half-width, in points, that :func:`_pairing` counts the seeds for: half the paper's bound.
RESOLUTION = 0.25


def _pairing(sd: float, spread: float) -> str:
    """What pairing bought: Adacc's paired differences against what two independent seeds would differ by
    (sqrt 2 x the baseline's spread), and how many seeds an interval of +-:data:`RESOLUTION` points would take."""
    seeds_needed = max(2, math.ceil((1.96 * sd / RESOLUTION) ** 2))
    independent = math.sqrt(2) * spread
    bought = ("they vary as much as two independent seeds would, so the runs from one seed decorrelate over "
              "these steps and pairing buys nothing" if sd >= independent else
              f"pairing cuts that to {sd / independent:.0%}")
    return (f"Adacc's paired differences have a {sd:.2f}% standard deviation against {independent:.2f}% for two "
            f"independent seeds: {bought}; an interval of +-{RESOLUTION} points would take about {seeds_needed} "
            "seeds")


def _against_bound(iv: dict) -> str:
    if iv["high"] is None:
        return "one seed leaves no interval to read the 0.5% against"
    if iv["high"] <= PAPER_BOUND:
        return f"the interval lies below the paper's +{PAPER_BOUND}%, so the claim holds here"
    if iv["low"] > PAPER_BOUND:
        return f"the interval lies above the paper's +{PAPER_BOUND}%, so the claim fails here"
    return f"the interval contains +{PAPER_BOUND}%: these seeds do not decide the claim"


def _sign(iv: dict, above: str, below: str) -> str:
    if iv["low"] is None:
        return "one seed, no interval"
    if iv["low"] > 0:
        return above
    if iv["high"] < 0:
        return below
    return "no difference these seeds resolve"
