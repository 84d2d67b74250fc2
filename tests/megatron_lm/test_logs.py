"""Reading Megatron-LM training logs (the lines training_log and report_memory print)."""

from __future__ import annotations

import json

import pytest

from megatron_adacc.bench import megatron_lm_logs as logs


def iteration_line(i: int, ms: float, loss: float, batch: int = 16, tflops: float | None = None) -> str:
    line = (f" [2026-11-22 05:00:00.000000] iteration {i:8d}/{20:8d} | consumed samples: {i * batch:12d} |"
            f" elapsed time per iteration (ms): {ms:.1f} |")
    if tflops is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    line += (f" learning rate: 1.000000E-04 | global batch size: {batch:5d} | lm loss: {loss:.6E} |"
             " loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |"
             " number of nan iterations:   0 |")
    return line


def memory_line(rank: int, it: int, max_mb: float) -> str:
    return (f"[Rank {rank}] (after {it} iterations) memory (MB) | allocated: 100.00 | max allocated: {max_mb:.2f}"
            " | reserved: 2000.00 | max reserved: 2000.00")


LOG = "\n".join([
    "> building train, validation, and test datasets for GPT ...",
    iteration_line(5, 900.0, 10.5, tflops=50.0),  # warm-up interval: left out of the median
    memory_line(0, 5, 1500.0),
    memory_line(1, 5, 1600.5),
    iteration_line(10, 200.0, 9.25, tflops=120.0),
    iteration_line(15, 220.0, 8.5, tflops=110.0),
    iteration_line(20, 210.0, 8.0, tflops=115.0),
    memory_line(0, 20, 1550.0),
])


def test_parse_log_hand_checked():
    m = logs.parse_log(LOG)
    assert m["status"] == "ok" and m["iterations"] == 20
    assert m["step_time_s"] == pytest.approx(0.210)  # median of 200, 220, 210 ms
    assert m["samples_per_s"] == pytest.approx(16 / 0.210)
    assert m["tflops_per_gpu"] == pytest.approx(115.0)
    assert m["final_loss"] == pytest.approx(8.0)
    assert m["peak_memory_bytes"] == int(1600.5 * 2**20)  # the largest max-allocated of any rank


def test_out_of_memory_and_empty_logs():
    oom = LOG.splitlines()[0] + "\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert logs.parse_log(oom)["status"] == "oom"
    assert logs.parse_log("nothing here")["status"] == "no-iterations"


def test_collect_and_write_summary(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "baseline-mbs8.log").write_text(LOG)
    (tmp_path / "logs" / "adacc-auto-mbs8.log").write_text(LOG.replace("200.0", "180.0"))
    (tmp_path / "logs" / "baseline-mbs16.log").write_text("CUDA out of memory")
    (tmp_path / "logs" / "notes.log").write_text("ignored: not METHOD-mbsN.log")
    table = logs.collect(tmp_path / "logs", seq_length=1024)
    assert list(table) == [8, 16] and set(table[8]) == {"baseline", "adacc-auto"}
    assert table[8]["baseline"]["tokens_per_s"] == pytest.approx(16 / 0.210 * 1024)
    assert table[16]["baseline"]["status"] == "oom"

    path = logs.write_summary(tmp_path / "logs", "megatron_lm_test", {"model": "x"}, 1024, tmp_path / "out")
    data = json.loads(path.read_text())
    assert data["methods"] == json.loads(json.dumps(table[8]))
    assert [b["micro_batch_size"] for b in data["batches"]] == [8, 16]
    assert "machine" in data and "date" in data["machine"]
