"""`adacc bench paper --report-only` rebuilds the report from a recorded paper.json, with readings computed from
the numbers; `--parts` refuses parts it does not know before running anything."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_adacc.adacc.policy.strategies.base import InfeasibleBudgetError
from megatron_adacc.bench import paper
from megatron_adacc.core.errors import AdaccError
from megatron_adacc.core.log import Steps


def _args(tmp_path, **kw) -> SimpleNamespace:
    base = dict(quick=True, output_dir=str(tmp_path), config=None, loss_config="tiny", batches=None, budget=None,
                steps=None, loss_steps=None, parts="fig5,fig6,fig7", report_only=False)
    base.update(kw)
    return SimpleNamespace(**base)


def _point(tok: float, peak_mib: float, fits: bool) -> dict:
    return {"tokens_per_s": tok, "peak_memory_bytes": int(peak_mib * 2**20), "fits": fits}


def _recorded() -> dict:
    sweep = {"baseline": {"4": _point(1000, 400, True), "8": _point(1100, 500, False)},
             "megatron_full": {"4": _point(700, 300, True), "8": _point(720, 350, True)},
             "quantization": {"4": _point(900, 320, True), "8": _point(950, 380, True)},
             "adacc": {"4": _point(990, 390, True), "8": _point(900, 440, True)}}
    return {
        "benchmark": "paper", "machine": {"platform": "test", "cpu_count": 2, "gpu": None, "date": "2026-11-22"},
        "versions": {"python": "3.11", "torch": "2.13", "megatron_core": "0.16.1", "codec_backend": "cpp"},
        "config": {"throughput_config": "tiny", "loss_config": "tiny", "batches": [4, 8], "steps": 4,
                   "loss_steps": 40, "quick": True},
        "methods": {}, "budget_bytes": 450 * 2**20, "loss_budget_bytes": 420 * 2**20, "sweep": sweep,
        "max_micro_batch": {"baseline": 4, "megatron_full": 8, "quantization": 8, "adacc": 8},
        "loss_curves": {"baseline": [3.0, 2.0], "quantization": [3.0, 2.1], "adacc": [3.0, 2.01],
                        "adacc_no_outlier": [3.0, 2.02]},
        "valid_loss": {"baseline": 2.0, "quantization": 2.1, "adacc": 2.004, "adacc_no_outlier": 2.03},
        "evolution": {"adacc": {"8": {"tokens_per_s": 1050}}, "adacc_no_evolution": {"8": {"tokens_per_s": 1000}}},
    }


def _rebuilt_report(tmp_path, data: dict) -> str:
    (tmp_path / "paper.json").write_text(json.dumps(data))
    paper.run(_args(tmp_path, report_only=True))
    return (tmp_path / "REPORT.md").read_text()


def test_report_only_rebuilds_the_report_with_readings_from_the_numbers(tmp_path) -> None:
    report = _rebuilt_report(tmp_path, _recorded())
    assert "| 8 | over budget (500 MiB) | 720 (350 MiB) | 950 (380 MiB) | 900 (440 MiB) | 1.25x |" in report
    assert "Here: 1.25-1.41x over the micro-batches where both fit." in report
    assert "Adacc +0.20% validation loss against the baseline (within the paper's 0.5%)" in report
    assert "Quantization +5.00%, worse than Adacc" in report
    assert "without outlier separation +1.50% (+1.30 points vs Adacc)" in report
    assert "Here: 1.05-1.05x" in report
    assert "a budget of 420 MiB" in report
    data = _recorded()  # the budget between the smallest one auto keeps (its refusal names it) and the baseline's
    data["loss_budget_from"] = {"auto_floor_bytes": 400 * 2**20, "baseline_peak_bytes": 480 * 2**20}
    assert ("a budget of 420 MiB, a quarter of the way from the smallest budget `--adacc-policy auto` keeps for this "
            "config (400 MiB, as its refusal of a smaller one names it) to the baseline's peak (480 MiB)"
            in _rebuilt_report(tmp_path, data))


def test_loss_differences_are_read_against_the_other_seed_and_a_vacuous_ablation_is_named(tmp_path) -> None:
    data = _recorded()
    data["config"]["loss_corpus"] = "shakespeare"
    data["loss_curves"]["baseline_other_seed"] = [3.0, 2.02]
    data["valid_loss"].update(baseline_other_seed=2.02, quantization=2.01)  # +1.00% spread; quant +0.50%
    data["loss_decisions"] = {"adacc": {"keep": 40, "recompute": 8, "compress:int4_asymmetric": 4},
                              "adacc_no_outlier": {"keep": 40, "recompute": 8, "compress:int4_asymmetric": 4}}
    report = _rebuilt_report(tmp_path, data)
    assert "loss on Shakespeare's plays" in report
    assert "| keep 40, recompute 8, int4_asymmetric 4 |" in report
    assert "another seed lands +1.00% from the baseline" in report
    assert "Quantization +0.50%, worse than Adacc by 0.30 points (within the seed-to-seed difference)" in report
    assert "compresses no tensor with outlier separation, so the ablation measures nothing here" in report

    data["loss_decisions"]["adacc"]["compress:int4_outlier"] = 4
    data["valid_loss"]["adacc_no_outlier"] = 2.05  # +2.50%, 2.30 points over Adacc: beyond a 1% spread
    report = _rebuilt_report(tmp_path, data)
    assert ("without outlier separation +2.50% (+2.30 points vs Adacc; above one seed-to-seed difference: a hint, "
            "not an ordering)") in report


def test_unknown_parts_are_refused_before_anything_runs(tmp_path) -> None:
    with pytest.raises(AdaccError, match="unknown --parts"):
        paper.run(_args(tmp_path, parts="fig5,fig9"))


def test_a_partial_run_needs_a_recorded_result(tmp_path) -> None:
    with pytest.raises(AdaccError, match="run every part"):
        paper.run(_args(tmp_path, parts="fig7"))


def test_a_first_partial_run_that_measures_the_budget_reports_the_parts_it_skipped_as_not_run(tmp_path,
                                                                                            monkeypatch) -> None:
    data = _recorded()
    sweep = {name: {int(mb): r for mb, r in v.items()} for name, v in data["sweep"].items()}
    monkeypatch.setattr(paper, "_fig5", lambda *a: (sweep, data["max_micro_batch"]))
    paper.run(_args(tmp_path, parts="fig5", budget="450MiB"))
    report = (tmp_path / "REPORT.md").read_text()
    assert "| 8 | over budget (500 MiB) | 720 (350 MiB) | 950 (380 MiB) | 900 (440 MiB) | 1.25x |" in report
    assert report.count("Not run in this recording") == 2
    assert "`--parts` without fig6" in report and "`--parts` without fig7" in report
    written = json.loads((tmp_path / "paper.json").read_text())
    assert written["loss_curves"] == {} and written["evolution"] == {}
    assert not (tmp_path / "paper_loss.png").exists() and not (tmp_path / "paper_evolution.png").exists()


def test_fig7_reads_medians_of_alternating_runs_and_a_gap_without_switches_as_noise(tmp_path) -> None:
    data = _recorded()
    data["config"]["fig7_repeats"] = 3
    no_switch = {"adacc_evolution": {"switches": []}}
    data["evolution"] = {
        "adacc": {"8": {"tokens_per_s": 1000, "tokens_per_s_runs": [950, 1000, 1080], "extensions": no_switch}},
        "adacc_no_evolution": {"8": {"tokens_per_s": 1040, "tokens_per_s_runs": [990, 1040, 1060]}}}
    report = _rebuilt_report(tmp_path, data)
    assert "| micro-batch 8 | 1,000 (950-1,080) | 1,040 (990-1,060) | 0.96x | 0 |" in report
    assert "Here: 0.96-0.96x (medians of 3 alternating runs each" in report
    assert "with 0 policy switch(es) over the runs" in report
    assert "the runs' ranges overlap." in report

    switched = {"adacc_evolution": {"switches": [{"iteration": 2}]}}
    data["evolution"]["adacc"]["8"].update(tokens_per_s=1300, tokens_per_s_runs=[1250, 1300, 1320],
                                           extensions=switched)
    report = _rebuilt_report(tmp_path, data)
    assert "Here: 1.25-1.25x" in report and "with 1 policy switch(es)" in report
    assert "ranges overlap" not in report


def test_a_point_adacc_refused_as_infeasible_shows_the_budget_it_needs(tmp_path) -> None:
    data = _recorded()
    refusal = InfeasibleBudgetError(450 * 2**20, 460 * 2**20)  # the run's last line, as point() keeps it
    data["sweep"]["adacc"]["8"] = {"error": f"[rank0]: {type(refusal).__name__}: {refusal}"[:300], "fits": False}
    data["sweep"]["quantization"]["8"] = {"error": "RuntimeError: out of memory", "fits": False}
    report = _rebuilt_report(tmp_path, data)
    assert "| 8 | over budget (500 MiB) | 720 (350 MiB) | error | no policy fits (needs 460 MiB) | - |" in report


def test_adacc_loss_is_read_one_sided_against_the_paper_and_against_the_spread(tmp_path) -> None:
    data = _recorded()
    data["loss_curves"]["baseline_other_seed"] = [3.0, 1.98]
    data["valid_loss"].update(baseline_other_seed=1.976)  # -1.20% spread
    data["valid_loss"]["adacc"] = 1.989  # -0.55%: lower loss meets "at most 0.5% worse"
    report = _rebuilt_report(tmp_path, data)
    assert ("Adacc -0.55% validation loss against the baseline (lower than the baseline's, which meets the "
            "paper's at most 0.5% worse; within the seed-to-seed difference)") in report
    data["valid_loss"]["adacc"] = 2.019  # +0.95%, inside a 1.2% spread
    report = _rebuilt_report(tmp_path, data)
    assert ("Adacc +0.95% validation loss against the baseline (more than the paper's 0.5% worse; within the "
            "seed-to-seed difference)") in report
    data["valid_loss"]["baseline_other_seed"] = 2.006  # +0.30% spread
    report = _rebuilt_report(tmp_path, data)
    assert "(more than the paper's 0.5% worse; above one seed-to-seed difference: a hint, not an ordering)" in report


def test_fig7_alternates_evolution_on_and_off_per_start_and_keeps_the_median_run(tmp_path) -> None:
    from megatron_adacc.bench import evolution as fig7
    from megatron_adacc.core.log import Steps
    from megatron_adacc.training import checkpoint

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "rank00000.json").write_text(json.dumps({"iteration": 3000}))
    calls = []
    speeds = {"adacc": iter([900, 1200, 1000, 5, 5, 5]), "adacc_no_evolution": iter([1100, 1050, 0, 5, 5, 5])}

    def train(flags, memory_run=True):  # noqa: ANN001 - train_method's signature
        name = "adacc_no_evolution" if "--adacc-no-evolution" in flags else "adacc"
        calls.append((name, flags[flags.index("--train-iters") + 1], "--load" in flags, memory_run))
        tps = next(speeds[name])
        if not tps:
            raise RuntimeError("killed\nby the test")
        return {"tokens_per_s": tps, "run": len(calls), "losses": [1.0]}

    evolution = fig7.run(["--config", "tiny"], {"fresh": None, "continued": ckpt}, budget=100, steps=40, repeats=3,
                         step=Steps(None, "test"), train=train)
    assert calls == ([("adacc", "40", False, False), ("adacc_no_evolution", "40", False, False)] * 3
                     + [("adacc", "3040", True, False), ("adacc_no_evolution", "3040", True, False)] * 3)
    on, off = evolution["adacc"]["fresh"], evolution["adacc_no_evolution"]["fresh"]
    assert (on["tokens_per_s"], on["tokens_per_s_runs"], on["run"]) == (1000, [900, 1200, 1000], 5)
    assert "losses" not in on and on["first_iteration"] == 1
    assert evolution["adacc"]["continued"]["first_iteration"] == 3001
    # a failed run is left out of the median, not counted as zero throughput
    assert (off["tokens_per_s"], off["tokens_per_s_runs"]) == (1075, [1100, 1050])
    assert checkpoint.saved_iteration(ckpt) == 3000


def test_a_switch_is_reported_with_its_predicted_and_measured_gain_and_no_switch_with_its_margin(tmp_path) -> None:
    """Measured: the run's median step before and after the switch, tracking iterations and the warm-up step left
    out (they pay for the probe); predicted: the cost model's overhead before and after. Without a switch the
    reading says how close the re-solves came to one."""
    from megatron_adacc.bench import evolution as fig7

    steps = [9.0, 5.0, 1.0, 5.0, 0.6, 0.6, 5.0, 0.6, 0.7, 0.5]  # iterations 3001..3010; tracking: 3002, 3004, 3007
    report = {"tracking_iterations": [3002, 3004, 3007], "tracks": [[3002, 0.1, 0.1, True], [3004, 0.1, 0.05, False],
                                                                    [3007, 0.05, 0.05, True]],
              "switches": [{"iteration": 3004, "reason": "predicted faster", "time_s": 0.05, "from_time_s": 0.1}]}
    run = {"tokens_per_s": 1200, "first_iteration": 3001, "step_times_s": steps,
           "extensions": {fig7.EXTENSION: report}}
    [sw] = fig7.switches(run)
    assert (sw["step_before_s"], sw["step_after_s"]) == (1.0, 0.6)
    evolution = {"adacc": {"continued": run}, "adacc_no_evolution": {"continued": {"tokens_per_s": 1000}}}
    lines = "\n".join(fig7.table(evolution))
    assert "| continued (from iteration 3001) | 1,200 | 1,000 | 1.20x | 1 |" in lines
    assert "| continued | 3004 | predicted faster | 100.0 -> 50.0 ms | 1000 -> 600 ms |" in lines

    report["switches"] = []
    report["tracks"][1][2] = 0.0995
    text = fig7.reading(evolution, repeats=1)
    assert "with 0 policy switch(es)" in text
    assert ("continued (from iteration 3001): at 2 of 3 tracking iterations the re-solve from the sampled "
            "statistics found the running policy again; the other re-solves were predicted +0.5% faster at most "
            "(a switch needs 2%).") in text


def test_every_listed_benchmark_runs_as_one(capsys) -> None:
    """`adacc bench outliers` was listed and ended in a traceback: a helper module is no benchmark."""
    import importlib

    from megatron_adacc.bench import harness

    for name in harness.available_benchmarks():
        module = importlib.import_module(f"megatron_adacc.bench.{name}")
        assert callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "run", None)), name


def test_fig4_draws_and_tabulates_the_outlier_counts_the_evolution_runs_recorded(tmp_path) -> None:
    """Fig. 4 runs nothing: it is the series policy evolution reported in the Fig. 7 runs with evolution on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_adacc.bench import outliers

    data = _recorded()
    assert "Fig. 4" not in _rebuilt_report(tmp_path, data)  # results recorded before the series: no section
    series = {"iterations": [1, 2, 4, 8], "channels": {"linear_fc1": 1024, "mlp_bda": 256},
              "profiled": {"linear_fc1": 30}, "ops": {"linear_fc1": [31.5, 20.0, 12.0, 8.0],
                                                      "mlp_bda": [2.0, None, 2.5, 3.0]}}
    data["evolution"]["adacc"]["8"]["extensions"] = {"adacc_evolution": {"switches": [],
                                                                         "outlier_channels": series}}
    report = _rebuilt_report(tmp_path, data)
    assert "## Fig. 4 — outlier channels during training" in report
    assert "| micro-batch 8: op | channels | profiled | iteration 1 | iteration 8 |" in report
    assert "| linear_fc1 | 1024 | 30 | 31.5 | 8 |" in report
    assert "| mlp_bda | 256 | - | 2 | 3 |" in report
    assert "micro-batch 8: from iteration 1 to 8, 1 of 2 ops fell and 1 rose." in report
    assert "![Fig. 4](paper_outliers.png)" in report and (tmp_path / "paper_outliers.png").stat().st_size > 0

    fig, ax = plt.subplots()  # the plotted lines are the series (a missing sample is skipped, not zero)
    outliers.draw(ax, series)
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    plt.close(fig)
    assert lines == {"linear_fc1": ([1, 2, 4, 8], [31.5, 20.0, 12.0, 8.0]), "mlp_bda": ([1, 4, 8], [2.0, 2.5, 3.0])}


@pytest.mark.parametrize("swept, limit, cap, want, probes", [
    ({4: True, 8: True}, 12, 32, 12, [16, 12, 14, 13]),      # doubling past the sweep, then halving the gap
    ({4: True, 8: True, 16: False}, 12, 32, 12, [12, 14, 13]),  # the first swept batch over the budget bounds it
    ({4: True, 8: True}, 100, 16, 16, [16]),                # the search stops at the cap
    ({4: False, 8: False}, 2, 32, 0, []),                   # nothing swept fits
])
def test_table3_finds_the_exact_largest_micro_batch(swept, limit, cap, want, probes) -> None:
    """Table 3's search: a method fitting 12 where another fits 8 is 1.5x, which powers of two would call equal."""
    asked = []
    fits = (lambda mb: asked.append(mb) or mb <= limit)
    got = paper._largest_batch({mb: {"fits": ok} for mb, ok in swept.items()}, cap, fits)
    assert (got, asked) == (want, probes)


def test_too_many_seeds_are_refused_before_anything_runs(tmp_path) -> None:
    with pytest.raises(AdaccError, match="--loss-seeds 9: choose 1 to 8"):
        paper.run(_args(tmp_path, parts="fig6", loss_seeds=9))


def test_fig6_trains_every_method_from_every_seed_and_keeps_the_first_seeds_curves(monkeypatch) -> None:
    calls = []

    def train(flags, memory_run=True):  # noqa: ANN001 - train_method's signature
        seed = int(flags[flags.index("--seed") + 1])
        calls.append((flags[flags.index("--adacc-policy") + 1] if "--adacc-policy" in flags else "none", seed,
                      "--adacc-memory-budget" in flags))
        if seed == 4321 and "quantize-all" in flags:
            raise RuntimeError("killed\nby the test")
        return {"losses": [3.0, 2.0], "valid_loss": 2.0 + seed / 1e5, "extensions": {}}

    monkeypatch.setattr(paper, "train_method", train)
    profiled = []
    monkeypatch.setattr(paper, "profile_for", lambda flags: profiled.append(flags[flags.index("--seed") + 1]))
    args = _args(None, loss_config="tiny")
    curves, seeded = paper._fig6(args, 10, "embedded", 123, [1234, 4321], Steps(None, "test"))
    assert calls == [(p, s, p == "auto") for s in (1234, 4321) for p in ("none", "quantize-all", "auto", "auto")]
    assert profiled == ["1234", "1234"]  # each auto method profiles once, not once per seed
    assert curves["baseline"]["valid_loss"] == 2.01234
    assert seeded["baseline"] == {1234: 2.01234, 4321: 2.04321}
    assert seeded["quantization"] == {1234: 2.01234}  # a failed run is left out, not counted


def test_a_seeded_recording_is_read_from_its_paired_intervals(tmp_path) -> None:
    data = _recorded()
    data["config"]["loss_seeds"] = [1234, 4321, 2718]
    data["seeded_valid_loss"] = {
        "baseline": {"1234": 2.0, "4321": 2.1, "2718": 1.9},
        "adacc": {"1234": 2.002, "4321": 2.1042, "2718": 1.9038},      # +0.10, +0.20, +0.20 %
        "quantization": {"1234": 2.02, "4321": 2.121, "2718": 1.919},  # +0.90, +0.80, +0.80 % vs Adacc
        "adacc_no_outlier": {"1234": 2.004, "4321": 2.1042, "2718": 1.9}}
    report = _rebuilt_report(tmp_path, data)
    assert "| adacc | 2.0020 | 2.1042 | 1.9038 | +0.17% (+0.02 to +0.31) |" in report
    assert "the baseline's validation loss varies by 5.00% (sample standard deviation) from seed to seed" in report
    assert "so the claim holds here" in report
    assert "Quantization +0.83% (+0.69 to +0.98) against Adacc: worse" in report
    # +0.10, 0, -0.20 %: mean -0.03, sd 0.153, half-width 4.303 * 0.153 / sqrt(3) = 0.38
    assert "without outlier separation -0.03% (-0.41 to +0.35) against Adacc: no difference these seeds resolve" \
        in report
    written = json.loads((tmp_path / "paper.json").read_text())
    assert written["seeded_valid_loss"]["adacc"]["4321"] == 2.1042
