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


def recorded_series(evolution: dict) -> list[tuple[str, dict[str, Any]]]:
    """``[(start, series)]`` of every evolution-on run that recorded one, in the order they ran (``fresh``, then
    ``continued``). Results recorded before Fig. 7 had starts are keyed by micro-batch: their largest one's."""
    found = [(start, series) for start, r in evolution.get(METHOD, {}).items()
             if (series := r.get("extensions", {}).get(EXTENSION, {}).get("outlier_channels"))
             and series.get("iterations") and series.get("ops")]
    if found and all(start.isdigit() for start, _ in found):
        return [max(found, key=lambda f: int(f[0]))]
    return found


def draw(ax: Any, series: dict[str, Any]) -> None:
    """One line per op: its outlier channels (mean over the run's layers) at each tracking iteration, against the
    iteration of the run (a continued run's first tracking iteration is its first), on a logarithmic axis
    (tracking iterations double)."""
    its = series["iterations"]
    first = its[0] - 1  # tracking starts at the run's first iteration
    for op, values in series["ops"].items():
        points = [(i - first, v) for i, v in zip(its, values) if v is not None]
        ax.plot([i for i, _ in points], [v for _, v in points], marker="o", label=op)
    if len(its) > 1:
        ax.set_xscale("log", base=2)
    ax.set(xlabel="iteration of the run" + (f" (after {first} pretrained)" if first else ""),
           ylabel="outlier channels (mean over layers)")
    ax.legend(fontsize=7)


def report_section(evolution: dict, png: str | None) -> list[str]:
    """The report's Fig. 4 section (markdown lines): per start, each op's count at the profile and at the first
    and last tracking iterations; empty when no run recorded the series."""
    found = recorded_series(evolution)
    if not found:
        return []
    lines = ["## Fig. 4 — outlier channels during training", "",
             "From the Fig. 7 runs with evolution on: each op's outlier channels (Z-score of channel absolute sums "
             "above the threshold, eq. 1; mean over the run's layers) in the profile the run solved from and at its "
             "tracking iterations, whether the policy kept, compressed or recomputed the op.", ""]
    for start, series in found:
        its, channels, profiled = series["iterations"], series.get("channels", {}), series.get("profiled", {})
        label = f"micro-batch {start}" if start.isdigit() else start
        lines += [f"| {label}: op | channels | profiled | iteration {its[0]} | iteration {its[-1]} |",
                  "|---|---|---|---|---|"]
        fell = rose = 0
        for op, values in series["ops"].items():
            seen = [v for v in values if v is not None]
            first, last = (seen[0], seen[-1]) if seen else (None, None)
            fell += bool(seen) and last < first
            rose += bool(seen) and last > first
            lines.append(f"| {op} | {channels.get(op, '-')} | {_cell(profiled.get(op))} | {_cell(first)} | "
                         f"{_cell(last)} |")
        lines += ["", f"{label}: from iteration {its[0]} to {its[-1]}, {fell} of {len(series['ops'])} ops fell and "
                  f"{rose} rose.", ""]
    if png:
        lines += [f"![Fig. 4]({png})", ""]
    lines += ["**Reading.** The paper: outlier counts fall during training, mostly early, so outlier-separated "
              "INT4 gets cheaper. The profile column is the one-layer sample model `auto` profiles at the start of "
              "each run (fresh weights, so for a continued run it is not the pretrained model): the first tracking "
              "iteration is where evolution first sees the trained model's own statistics.", ""]
    return lines


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
