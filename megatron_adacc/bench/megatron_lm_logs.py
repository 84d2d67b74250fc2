"""Read step time, throughput and peak memory out of a Megatron-LM training log.

``scripts/megatron_lm_paper_comparison.sh`` runs ``pretrain_gpt.py`` once per method and batch size and keeps
each log; this module turns those logs into the benchmark metrics (``step_time_s``, ``tokens_per_s``,
``peak_memory_bytes``, ``final_loss``) that ``benchmarks/results/*.json`` use everywhere in this project.
It reads the lines ``training_log`` prints (``iteration N/M | ... elapsed time per iteration (ms): X | ...
lm loss: Y |``) and ``report_memory``'s ``[Rank r] (after N iterations) memory (MB) | ... max allocated: Z``.

Usage: ``python -m megatron_adacc.bench.megatron_lm_logs LOG [LOG ...]`` prints one JSON object per log;
``--summarize DIR --name NAME`` writes ``benchmarks/results/NAME.json`` from ``DIR/METHOD-mbsN.log``.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|")
_FIELD = re.compile(r"\|?\s*([A-Za-z][A-Za-z0-9 ()/_-]*?):\s*([-+0-9.eE]+|nan|inf)\s*\|")
_MEMORY = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\).*?\| max allocated: ([0-9.]+)")
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory")


def parse_log(text: str, *, skip_first: int = 1) -> dict[str, Any]:
    """Metrics of one run. ``skip_first`` iteration lines (warm-up, compilation) are left out of the median.

    Returns ``status`` ("ok", "oom" or "no-iterations"), ``iterations``, ``step_time_s`` (median),
    ``global_batch_size``, ``tokens_per_s`` (needs ``seq_length`` from the caller, so only
    ``samples_per_s`` here), ``tflops_per_gpu`` (median, when logged), ``final_loss`` and
    ``peak_memory_bytes`` (largest ``max allocated`` of any rank).
    """
    steps: list[float] = []
    tflops: list[float] = []
    batch = None
    loss = None
    last_iteration = 0
    for line in text.splitlines():
        match = _ITERATION.search(line)
        if not match:
            continue
        last_iteration = int(match.group(1))
        fields = {name.strip(): value for name, value in _FIELD.findall(line[match.end() - 1:])}
        if "elapsed time per iteration (ms)" in fields:
            steps.append(float(fields["elapsed time per iteration (ms)"]) / 1000.0)
        if "throughput per GPU (TFLOP/s/GPU)" in fields:
            tflops.append(float(fields["throughput per GPU (TFLOP/s/GPU)"]))
        if "global batch size" in fields:
            batch = int(float(fields["global batch size"]))
        if "lm loss" in fields:
            loss = float(fields["lm loss"])
    peaks = [float(m.group(3)) for m in _MEMORY.finditer(text)]
    result: dict[str, Any] = {"iterations": last_iteration}
    if _OOM.search(text):
        result["status"] = "oom"
    elif not steps:
        result["status"] = "no-iterations"
    else:
        result["status"] = "ok"
    timed = steps[skip_first:] or steps
    if timed:
        result["step_time_s"] = statistics.median(timed)
        if batch:
            result["global_batch_size"] = batch
            result["samples_per_s"] = batch / result["step_time_s"]
    if tflops:
        result["tflops_per_gpu"] = statistics.median(tflops[skip_first:] or tflops)
    if loss is not None:
        result["final_loss"] = loss
    if peaks:
        result["peak_memory_bytes"] = int(max(peaks) * 2**20)
    return result


_LOG_NAME = re.compile(r"^(?P<method>[A-Za-z0-9_.+-]+?)-mbs(?P<mbs>\d+)\.log$")


def collect(log_dir: str | Path, seq_length: int) -> dict[int, dict[str, dict[str, Any]]]:
    """``{micro_batch_size: {method: metrics}}`` from the ``METHOD-mbsN.log`` files in ``log_dir``.

    Adds ``tokens_per_s`` (samples per second x ``seq_length``), the shared metric name of this project.
    """
    table: dict[int, dict[str, dict[str, Any]]] = {}
    for path in sorted(Path(log_dir).glob("*.log")):
        match = _LOG_NAME.match(path.name)
        if not match:
            continue
        metrics = parse_log(path.read_text(errors="replace"))
        if "samples_per_s" in metrics:
            metrics["tokens_per_s"] = metrics["samples_per_s"] * seq_length
        table.setdefault(int(match["mbs"]), {})[match["method"]] = metrics
    return dict(sorted(table.items()))


def write_summary(log_dir: str | Path, name: str, config: dict[str, Any], seq_length: int,
                  output_dir: str | Path | None = None) -> Path:
    """``benchmarks/results/NAME.json`` in the common format: ``batches`` has one entry per micro-batch size
    with its own ``methods`` map; the top-level ``methods`` is the smallest batch size's."""
    from megatron_adacc.bench.harness import write_results

    table = collect(log_dir, seq_length)
    if not table:
        raise FileNotFoundError(f"no METHOD-mbsN.log files in {log_dir}")
    batches = [{"micro_batch_size": mbs, "methods": methods} for mbs, methods in table.items()]
    from types import SimpleNamespace

    return write_results(name, config, batches[0]["methods"], extra={"batches": batches},
                         args=SimpleNamespace(output_dir=output_dir))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_adacc.bench.megatron_lm_logs",
                                     description="Metrics from Megatron-LM training logs.")
    parser.add_argument("logs", nargs="*", help="log files: print one JSON object per log")
    parser.add_argument("--summarize", metavar="DIR", help="collect DIR/METHOD-mbsN.log into a results JSON")
    parser.add_argument("--name", default="megatron_lm", help="results name (benchmarks/results/NAME.json)")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--config-json", default="{}", help="the run's configuration, stored as `config`")
    parser.add_argument("--output-dir", default=None, help="default: benchmarks/results")
    ns = parser.parse_args(argv)
    for path in ns.logs:
        print(json.dumps({"log": path, **parse_log(Path(path).read_text(errors="replace"))}))
    if ns.summarize:
        write_summary(ns.summarize, ns.name, json.loads(ns.config_json), ns.seq_length, ns.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
