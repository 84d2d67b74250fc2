"""Fig. 7 of the Adacc paper for ``adacc bench paper``: policy evolution on and off, on runs long enough for
outlier statistics to drift.

The paper's gain (1.11-1.2x on GPT-117M/345M) comes from outlier counts falling during training, so that
outlier-separated INT4 becomes cheaper than recompute for more tensors. A few dozen steps from random weights
show no such drift, so Fig. 7 trains the loss config on the loss corpus for a few hundred steps under the Fig. 6
budget (where Adacc's policy compresses and recomputes) from two starts:

* ``fresh``: from random initialisation;
* ``continued``: from a checkpoint of the same model pretrained stock (``adacc train --save``; by default this
  module trains and caches one). ``--adacc-policy auto`` profiles its one-layer sample model at the start of the
  run, and evolution tracks from there (iterations 1, 2, 4, ... of the run), so its first samples see how the
  pretrained weights' statistics differ from the profile's.

Each start runs evolution on and off ``repeats`` times in alternation, compared by their medians. A switch is
reported with its predicted gain (the cost model's overhead per micro-batch before and after) and its measured
one (the median step time before and after the switch in the same run, tracking iterations left out), and the
evolution-on runs record the outlier counts of Fig. 4 (:mod:`megatron_adacc.bench.outliers`).
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable
from pathlib import Path

from megatron_adacc.bench.common import interleaved_runs, train_method
from megatron_adacc.core.log import Steps
from megatron_adacc.training.checkpoint import saved_iteration

#: Fig. 7 methods.
METHODS = {
    "adacc": ["--adacc-policy", "auto"],
    "adacc_no_evolution": ["--adacc-policy", "auto", "--adacc-no-evolution"],
}
ON, OFF = "adacc", "adacc_no_evolution"
#: The extension whose report carries the switches and the outlier series.
EXTENSION = "adacc_evolution"
#: Steps of each Fig. 7 run, and of the stock pretraining the continued runs start from.
DEFAULT_STEPS, DEFAULT_PRETRAIN_ITERS = 300, 3000
#: Evolution's backoff cap in these runs: tracking iterations 1, 2, 4, ..., 32, then every 32.
CAP = 32
FRESH, CONTINUED = "fresh", "continued"
#: Where the stock checkpoints the continued runs start from are kept between benchmark runs.
PRETRAINED_CACHE = Path("~/.cache/megatron-adacc/pretrained")



def pretrained_checkpoint(config: str, corpus: str, iters: int, step: Steps) -> Path:
    """A stock checkpoint of ``config`` trained ``iters`` iterations on ``corpus``, trained once and cached (it
    takes tens of minutes on 2 CPU cores): ``~/.cache/megatron-adacc/pretrained/<config>-<corpus>-<iters>``."""
    key = hashlib.sha256(f"{config}|{corpus}|{iters}".encode()).hexdigest()[:8]
    path = PRETRAINED_CACHE.expanduser() / f"{config}-{corpus}-{iters}-{key}"
    if (path / "done").is_file():
        return path
    step.note(f"fig7: pretraining {config} on {corpus} for {iters} iterations (stock, cached in {path})")
    train_method(["--config", config, "--corpus", corpus, "--train-iters", str(iters), "--save", str(path),
                  "--save-interval", "500"], memory_run=False, timeout=6 * 3600)
    (path / "done").write_text(f"{iters}\n")
    return path


def run(common: list[str], starts: dict[str, Path | None], budget: int, steps: int, repeats: int,
        step: Steps, train: Callable[..., dict] = train_method) -> dict:
    """``{method: {start: result}}``: for each start (None: fresh; a checkpoint: continued from it), ``repeats``
    runs of each method in alternation; each side reports its median run, every run's throughput kept as
    ``tokens_per_s_runs``. ``common`` names the config and corpus."""
    evolution: dict[str, dict[str, dict]] = {m: {} for m in METHODS}
    for start, ckpt in starts.items():
        first = 0 if ckpt is None else saved_iteration(ckpt)
        flags = common + ["--train-iters", str(first + steps), "--adacc-memory-budget", str(budget),
                          "--adacc-evolution-cap", str(CAP)] + ([] if ckpt is None else ["--load", str(ckpt)])

        def one(name: str, flags: list[str] = flags, start: str = start, first: int = first) -> dict:
            step(f"fig7: {name}, {start}")
            try:  # throughput only: Fig. 7 compares speed, so no separate memory run
                r = train(METHODS[name] + flags, memory_run=False)
            except RuntimeError as exc:
                return {"error": str(exc).strip().splitlines()[-1][:300]}
            r.pop("losses", None)
            return dict(r, first_iteration=first + 1)

        for name, rs in interleaved_runs(one, METHODS, repeats).items():
            evolution[name][start] = _median_run(rs)
    return evolution


def _median_run(rs: list[dict]) -> dict:
    timed = [r for r in rs if r.get("tokens_per_s")]
    if not timed:
        return rs[0]
    tps = [r["tokens_per_s"] for r in timed]
    median = statistics.median(tps)
    median_run = min(timed, key=lambda r: abs(r["tokens_per_s"] - median))
    return dict(median_run, tokens_per_s=median, tokens_per_s_runs=tps)


def runs_of(result: dict) -> list[float]:
    """Every run's throughput of a Fig. 7 point (results recorded before alternating runs hold only one)."""
    return result.get("tokens_per_s_runs") or [result["tokens_per_s"]]


def switches(result: dict) -> list[dict] | None:
    """The switches of an evolution-on run, each with its measured step times before and after (medians over
    the run's iterations, tracking iterations and the first, warm-up, step left out); None when not recorded."""
    report = result.get("extensions", {}).get(EXTENSION)
    if report is None:
        return None
    times, first = result.get("step_times_s") or [], int(result.get("first_iteration", 1))
    tracking = set(report.get("tracking_iterations") or [])
    rows = []
    for sw in report.get("switches") or []:
        it = int(sw["iteration"])  # the new policy runs from the next iteration on
        before = [t for i, t in enumerate(times[1:], first + 1) if i <= it and i not in tracking]
        after = [t for i, t in enumerate(times[1:], first + 1) if i > it and i not in tracking]
        rows.append(dict(sw, step_before_s=statistics.median(before) if before else None,
                         step_after_s=statistics.median(after) if after else None))
    return rows


def table(evolution: dict) -> list[str]:
    """The report's Fig. 7 table (markdown lines): throughput per start, the ratio, and every switch."""
    def cell(r: dict) -> str:
        if not r.get("tokens_per_s"):
            return "error"
        runs = runs_of(r)
        spread = f" ({min(runs):,.0f}-{max(runs):,.0f})" if len(runs) > 1 else ""
        return f"{r['tokens_per_s']:,.0f}{spread}"

    lines = ["| start | " + " | ".join(evolution) + " | ratio | switches |", "|---|" + "---|" * (len(evolution) + 2)]
    on = evolution.get(ON, {})
    for start in _starts(evolution):
        results = [evolution[n].get(start, {}) for n in evolution]
        vals = [r.get("tokens_per_s") for r in results]
        ratio = f"{vals[0] / vals[-1]:.2f}x" if vals[0] and vals[-1] else "-"
        rows = switches(on.get(start, {}))
        lines.append(f"| {_start_label(start, on.get(start, {}))} | " + " | ".join(cell(r) for r in results)
                     + f" | {ratio} | {'-' if rows is None else len(rows)} |")
    lines += _switch_lines(on)
    return lines


def _switch_lines(on: dict) -> list[str]:
    rows = [(start, sw) for start in on for sw in (switches(on[start]) or [])]
    if not rows:
        return []
    lines = ["", "| start | iteration | reason | predicted overhead per micro-batch | measured step time "
             "(median before -> after) |", "|---|---|---|---|---|"]
    for start, sw in rows:
        predicted = (f"{sw['from_time_s'] * 1e3:.1f} -> {sw['time_s'] * 1e3:.1f} ms"
                     if sw.get("from_time_s") is not None and sw.get("time_s") is not None else "-")
        measured = (f"{sw['step_before_s'] * 1e3:.0f} -> {sw['step_after_s'] * 1e3:.0f} ms"
                    if sw.get("step_before_s") and sw.get("step_after_s") else "-")
        lines.append(f"| {start} | {sw['iteration']} | {sw.get('reason', '')} | {predicted} | {measured} |")
    return lines


def _starts(evolution: dict) -> list[str]:
    return list(dict.fromkeys(start for v in evolution.values() for start in v))


def _start_label(start: str, result: dict) -> str:
    if start.isdigit():  # results recorded before Fig. 7 had starts were keyed by micro-batch
        return f"micro-batch {start}"
    first = result.get("first_iteration")
    return f"{start} (from iteration {first})" if start == CONTINUED and first else start


def reading(evolution: dict, repeats: int) -> str:
    """The Fig. 7 reading, computed from the numbers: the ratio per start against the runs' spread, and what the
    switches (or their absence) mean."""
    paper = ("The paper: evolution adds 1.11-1.2x throughput on GPT-117M/345M, because outlier counts fall during "
             "training and compression becomes cheaper than recompute for more tensors. ")
    on, off = evolution.get(ON, {}), evolution.get(OFF, {})
    starts = [s for s in on if on[s].get("tokens_per_s") and off.get(s, {}).get("tokens_per_s")]
    if not starts:
        return paper + "Here: no pair of runs to compare."
    ratios = [on[s]["tokens_per_s"] / off[s]["tokens_per_s"] for s in starts]
    found = [switches(on[s]) for s in starts]
    how = (f"medians of {repeats} alternating runs each; the table's ranges are the runs' spread"
           if repeats > 1 else "one run each, so the ratio carries the machine's full run-to-run noise")
    text = paper + f"Here: {min(ratios):.2f}-{max(ratios):.2f}x ({how})"
    if any(f is None for f in found):
        return text + "."
    count = sum(len(f) for f in found)
    text += f", with {count} policy switch(es) over the runs"
    overlap = all(min(runs_of(on[s])) <= max(runs_of(off[s])) and min(runs_of(off[s])) <= max(runs_of(on[s]))
                  for s in starts)
    boundary = " ".join(filter(None, (_boundary(s, on[s]) for s in starts)))
    if count == 0:
        return text + (". Without a switch both sides train the same policy, so the ratio measures the tracking "
                       "iterations' cost and the machine: " + ("the runs' ranges overlap. " if overlap and repeats > 1
                                                             else "a gap this size is run-to-run noise here. ")
                       + boundary)
    return text + (". " + ("The runs' ranges overlap, so the gain is within noise. " if overlap and repeats > 1
                           else "The switches changed the policy mid-run; compare the ratio with the ranges. ")
                   + boundary)


def _boundary(start: str, result: dict) -> str:
    """How close one evolution-on run came to a switch: at how many tracking iterations the re-solve from the
    sampled statistics found the running policy again, and how much faster the best other one was predicted
    (a switch needs :data:`~megatron_adacc.adacc.integration.evolution.MIN_GAIN`)."""
    from megatron_adacc.adacc.integration.evolution import MIN_GAIN

    tracks = result.get("extensions", {}).get(EXTENSION, {}).get("tracks")
    if not tracks:
        return ""
    same = sum(1 for t in tracks if t[3])
    gains = [(cur - cand) / cur for _, cur, cand, is_same in tracks if cand is not None and cur and not is_same]
    text = (f"{_start_label(start, result)}: at {same} of {len(tracks)} tracking iterations the re-solve from the "
            "sampled statistics found the running policy again")
    if gains:
        text += (f"; the other re-solves were predicted {max(gains) * 100:+.1f}% faster at most (a switch needs "
                 f"{MIN_GAIN * 100:.0f}%)")
    return text + "."


def draw(ax, evolution: dict) -> None:
    """Bars per start (median throughput), whiskers spanning the alternating runs."""
    names, starts = list(evolution), _starts(evolution)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ys = [evolution[name].get(s, {}).get("tokens_per_s") or 0 for s in starts]
        runs = [runs_of(evolution[name][s]) if y else [0] for s, y in zip(starts, ys)]
        err = [[y - min(r) for y, r in zip(ys, runs)], [max(r) - y for y, r in zip(ys, runs)]]
        ax.bar([j + i * width for j in range(len(starts))], ys, width=width, label=name, yerr=err, capsize=4)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(starts))],
                  [_start_label(s, evolution.get(ON, {}).get(s, {})) for s in starts])
    ax.set(ylabel="tokens / s", title="Fig. 7: adaptive policy evolution")
    ax.legend()
