"""Fig. 4 of the Adacc paper, outlier channels per op against the training iteration, for ``adacc bench paper``.

Nothing is run for it: policy evolution samples every outlier-separated op on its tracking iterations and
reports the series (``report()["outlier_channels"]`` of
:class:`~megatron_adacc.adacc.integration.evolution.PolicyEvolution`), which the Fig. 7 runs with evolution on
already record in the benchmark's JSON. This module picks that series, draws it and writes its report section.
"""

from __future__ import annotations

from typing import Any

#: The Fig. 7 method whose runs carry the series, and the extension that reports it.
METHOD, EXTENSION = "adacc", "adacc_evolution"


def recorded_series(evolution: dict) -> tuple[int, dict[str, Any]] | None:
    """``(micro-batch, series)`` of the evolution-on run at the largest micro-batch that recorded one, or None
    (results recorded before the series existed, or runs that failed)."""
    runs = evolution.get(METHOD, {})
    for mb in sorted(runs, reverse=True):
        series = runs[mb].get("extensions", {}).get(EXTENSION, {}).get("outlier_channels")
        if series and series.get("iterations") and series.get("ops"):
            return mb, series
    return None


def draw(ax: Any, series: dict[str, Any]) -> None:
    """One line per op: its outlier channels (mean over the run's layers) at each tracking iteration, on a
    logarithmic iteration axis (tracking iterations double)."""
    its = series["iterations"]
    for op, values in series["ops"].items():
        points = [(i, v) for i, v in zip(its, values) if v is not None]
        ax.plot([i for i, _ in points], [v for _, v in points], marker="o", label=op)
    if len(its) > 1:
        ax.set_xscale("log", base=2)
    ax.set(xlabel="iteration", ylabel="outlier channels (mean over layers)")
    ax.legend(fontsize=7)


def report_section(evolution: dict, png: str | None) -> list[str]:
    """The report's Fig. 4 section (markdown lines); empty when no run recorded the series."""
    found = recorded_series(evolution)
    if found is None:
        return []
    mb, series = found
    its, channels, profiled = series["iterations"], series.get("channels", {}), series.get("profiled", {})
    lines = ["## Fig. 4 — outlier channels during training", "",
             f"From the Fig. 7 run with evolution on at micro-batch {mb}: each op's outlier channels (Z-score of "
             "channel absolute sums above the threshold, eq. 1; mean over the run's layers) at every tracking "
             "iteration, whether the policy kept, compressed or recomputed the op.", "",
             f"| op | channels | profiled | iteration {its[0]} | iteration {its[-1]} |", "|---|---|---|---|---|"]
    fell = rose = 0
    for op, values in series["ops"].items():
        seen = [v for v in values if v is not None]
        first, last = (seen[0], seen[-1]) if seen else (None, None)
        if seen and last < first:
            fell += 1
        elif seen and last > first:
            rose += 1
        lines.append(f"| {op} | {channels.get(op, '-')} | {_cell(profiled.get(op))} | {_cell(first)} | "
                     f"{_cell(last)} |")
    if png:
        lines += ["", f"![Fig. 4]({png})"]
    lines += ["", "**Reading.** The paper: outlier counts fall during training, mostly early, so outlier-separated "
              f"INT4 gets cheaper. Here, from iteration {its[0]} to {its[-1]}: {fell} of {len(series['ops'])} ops "
              f"fell and {rose} rose.", ""]
    return lines


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
