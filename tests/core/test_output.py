"""What megatron-adacc prints: sizes in the units people write, tables that fit 100 columns, log lines through
the package logger (rank 0 only, quiet on request), and progress that shows only where someone watches."""

from __future__ import annotations

import logging
import pickle

import pytest

from megatron_adacc.core import log
from megatron_adacc.core.tables import WIDTH, fit_widths, format_table, wrap
from megatron_adacc.core.units import Size, format_bytes, parse_bytes


# ----------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("text, value", [("1G", 2**30), ("30G", 30 * 2**30), ("1GiB", 2**30), ("1GB", 10**9),
                                         ("512M", 2**29), ("512MB", 512 * 10**6), ("2k", 2048), ("1T", 2**40)])
def test_a_bare_unit_letter_is_binary_and_a_b_makes_it_decimal(text, value):
    """``30G`` used to be read as 30 * 10**9 (27.94 GiB) while every log prints GiB."""
    assert parse_bytes(text) == value


def test_a_size_prints_back_in_the_units_it_was_written_in():
    assert format_bytes(parse_bytes("30GB"), 2) == "30.00 GB"
    assert format_bytes(parse_bytes("30G"), 2) == "30.00 GiB" == format_bytes(parse_bytes("30GiB"), 2)
    assert format_bytes(int(29.5e9), 1, like=parse_bytes("30GB")) == "29.5 GB"  # a prediction beside the budget
    assert format_bytes(3 * 2**30) == "3.0 GiB"  # a plain number: binary, as before


def test_a_size_keeps_its_units_through_pickle_and_arithmetic_gives_plain_ints():
    size = parse_bytes("800MB")
    again = pickle.loads(pickle.dumps(size))  # the profiler's child receives the arguments pickled
    assert isinstance(again, Size) and again == 800 * 10**6 and again.decimal
    assert type(size * 2) is int and format_bytes(size // 2) == "381.5 MiB"


# ---------------------------------------------------------------------------------------------- tables
#: The widest table each bench prints: its columns as `adacc bench NAME` heads them, with cells as wide as they
#: come (the longest method names, values with their ratio to the baseline).
_BENCH_TABLES = {
    "recompute/policies/budget": (["method", "step time", "tokens/s", "peak memory", "held for backward",
                                   "final loss"],
                                  ["adacc_quantize_all", "1234.5 ms (1.23x)", "12,345 (0.81x)",
                                   "1023.9 MiB (0.95x)", "1023.9 MiB (0.95x)", "10.123 (1.00x)"]),
    "codecs": (["method", "compress GB/s", "decompress GB/s", "copy GB/s", "roundtrip vs copy",
                "roundtrip vs copy best", "compression ratio", "max rel error", "rms rel error"],
               ["int4_channelwise@64MB[bf16][cuda]", "1,234", "1,234", "1,234", "0.123", "0.123", "7.123", "0.123",
                "0.123"]),
    "gact": (["method", "held for backward", "peak memory", "largest micro batch", "step time", "final loss"],
             ["gact_fixed4", "1023.9 MiB (0.25x)", "1023.9 MiB (0.95x)", "128 (4.00x)", "1234.5 ms (1.23x)",
              "10.123 (1.00x)"]),
    "resireduce": (["method", "residual", "model state", "peak memory", "bytes sent per step", "step time",
                    "reduce overhead", "final loss", "mean loss last5"],
                   ["resireduce_w2d", "123.4 MiB (0.50x)", "123.4 MiB (0.87x)", "1023.9 MiB (0.95x)",
                    "123.4 KiB (1.00x)", "1234.5 ms (1.02x)", "12.345 ms (1.10x)", "10.123 (1.00x)",
                    "10.123 (1.00x)"]),
    "adama": (["method", "step time", "step time min", "tokens/s", "peak memory", "training memory",
               "gradient held", "final loss"],
              ["adam_accumulation", "1234.5 ms (1.23x)", "1234.5 ms (1.23x)", "12,345 (0.81x)",
               "1023.9 MiB (0.95x)", "1023.9 MiB (0.95x)", "1023.9 MiB (0.95x)", "10.123 (1.00x)"]),
    "adama-distributed": (["method", "peak memory", "training memory", "optimizer state", "gradient buffer",
                           "gradient held", "step time", "final loss"],
                          ["megatron_distributed_optimizer", "1023.9 MiB (0.95x)", "1023.9 MiB (0.95x)",
                           "1023.9 MiB (1.00x)", "1023.9 MiB (0.00x)", "1023.9 MiB (0.95x)", "1234.5 ms (1.23x)",
                           "10.123 (1.00x)"]),
    "show": (["op", "decision", "saved if kept", "stored", "time cost"],
             ["pre_mlp_layernorm", "compress:int4_outlier (z_threshold=3.0)", "1023.99 MiB", "1023.99 MiB",
              "1234.567 ms"]),
}


@pytest.mark.parametrize("name", list(_BENCH_TABLES))
def test_every_bench_table_fits_100_columns(name):
    header, row = _BENCH_TABLES[name]
    natural = sum(max(len(h), len(c)) for h, c in zip(header, row)) + 2 * (len(row) - 1)
    text = format_table(header, [row, row])
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    # nothing is lost: every word of every cell is still there, in order
    assert " ".join(text.split()).count(row[0].split()[0][:5]) >= 2
    if natural <= WIDTH:  # a table that fits is left as it is: one line per row
        assert len(text.splitlines()) == 4


def test_a_wide_table_wraps_values_before_names_and_never_drops_text():
    text = format_table(["method", "step time", "peak memory"], [["megatron_selective", "123.4 ms (1.00x)",
                                                                  "1.2 GiB (0.90x)"]], width=40)
    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("megatron_selective  123.4 ms"))  # name whole
    assert "(1.00x)" in lines[row + 1] and max(map(len, lines)) <= 40
    assert wrap("int4_channelwise@16MB[cuda]", 12) == ["int4_", "channelwise@", "16MB[cuda]"]
    assert fit_widths([["x" * 300]], width=100) == [100]  # nowhere to break: cut, still within the width


def test_right_aligned_columns_and_the_rule():
    lines = format_table(["op", "bytes"], [["a", "1 B"], ["bb", "10 KiB"]], right=[1]).splitlines()
    assert lines == ["op   bytes", "--  ------", "a      1 B", "bb  10 KiB"]


# --------------------------------------------------------------------------------------------- logging
def test_the_library_is_silent_until_a_front_end_installs_the_handler(capsys):
    log.get_logger().info("not shown")
    log.install()
    log.get_logger().info("shown")
    log.get_logger("resireduce").warning("careful")
    assert capsys.readouterr().err.splitlines() == ["[adacc] shown", "[resireduce] WARNING: careful"]


def test_quiet_keeps_warnings_and_a_host_level_does_not_override_the_users_flag(capsys, monkeypatch):
    log.install(logging.WARNING, pin=True)  # adacc -q
    log.install(logging.DEBUG)  # then Megatron-LM's --logging-level 10
    log.get_logger().info("status")
    log.get_logger().warning("a warning")
    assert capsys.readouterr().err == "[adacc] WARNING: a warning\n"
    import os

    assert os.environ[log.LEVEL_ENV] == str(logging.WARNING)  # what the processes it starts inherit


def test_only_rank_0_prints_below_error_and_other_ranks_say_whose_error(capsys, monkeypatch):
    log.install()
    monkeypatch.setattr(log, "rank", lambda: 1)  # as torch.distributed or torchrun's RANK says
    log.get_logger().info("status")
    log.get_logger().warning("warning")
    log.get_logger().error("broken")
    assert capsys.readouterr().err == "[adacc] rank 1: ERROR: broken\n"


def test_the_rank_is_torchruns_before_torch_distributed_starts(monkeypatch):
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("this worker already joined a process group, whose rank wins")
    monkeypatch.setenv("RANK", "3")
    assert log.rank() == 3


def test_the_level_is_a_number_or_a_name():
    assert log.level_of("20") == log.level_of("info") == log.level_of(20) == logging.INFO
    with pytest.raises(ValueError, match="not a logging level"):
        log.level_of("loud")


def test_steps_log_a_line_each_where_no_bar_shows(capsys):
    """Standard error is not a terminal here (captured), as in CI: one line per step instead of a bar."""
    log.install()
    with log.Steps(2, "recompute") as step:
        for _ in step.iterate(["megatron_none", "megatron_full"]):
            pass
    assert capsys.readouterr().err.splitlines() == ["[bench] recompute: megatron_none ...",
                                                    "[bench] recompute: megatron_full ..."]
    log.install(logging.WARNING, pin=True)  # -q: no lines, no bar
    with log.Steps(1, "recompute") as step:
        step("megatron_none")
    assert capsys.readouterr().err == "" and not log.shows_progress()


def test_a_bar_shows_on_a_terminal_and_not_under_quiet(monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    log.install()
    assert not log.progress(total=3).disable
    log.install(logging.WARNING, pin=True)
    assert log.progress(total=3).disable


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    """`adacc show p.json | head`: the pipe closes while adacc still writes; a Unix filter stops quietly."""
    import subprocess
    import sys

    from megatron_adacc.adacc.policy.io import save_policy
    from megatron_adacc.adacc.policy.policy import Policy

    path = save_policy(Policy.all_recompute(400), tmp_path / "long.json")  # one table per layer: ~8000 lines
    proc = subprocess.Popen([sys.executable, "-m", "megatron_adacc.cli", "show", "--all-layers", "--all-ops",
                             str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(100)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err
