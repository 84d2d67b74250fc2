"""core.lazy (package faces that import on first use) and core.units (sizes)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from megatron_adacc.core.units import format_bytes, parse_bytes, parse_positive_bytes


@pytest.mark.parametrize("text, value", [("12GiB", 12 * 2**30), ("500MB", 500_000_000), ("1.5 KiB", 1536),
                                         ("42", 42), (7, 7)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["12 parsecs", "GiB", "-1MiB", ""])
def test_parse_bytes_refuses_with_an_example(text):
    with pytest.raises(argparse.ArgumentTypeError, match="e.g. 12GiB"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["0", "0.5", "0GiB", "0.1B"])
def test_budgets_must_be_positive(text):
    """``--adacc-memory-budget 0`` (or ``0.5``, which truncates to 0 bytes) used to read as "no budget": all RAM."""
    with pytest.raises(argparse.ArgumentTypeError, match="must be positive"):
        parse_positive_bytes(text)
    assert parse_positive_bytes("1") == 1 and parse_positive_bytes("0.5KiB") == 512


def test_the_budget_flags_refuse_zero():
    from megatron_adacc import features

    parser = argparse.ArgumentParser()
    features.add_args(parser)
    for flag in ("--adacc-memory-budget", "--adacc-process-baseline"):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "0"])


def test_format_bytes():
    assert [format_bytes(n) for n in (None, 512, 1536, 3 * 2**30)] == ["-", "512 B", "1.5 KiB", "3.0 GiB"]
    assert format_bytes(2**20 + 2**19, digits=2) == "1.50 MiB"


def test_feature_faces_import_their_names_on_first_use_only():
    code = ("import sys; import megatron_adacc.comm as c, megatron_adacc.gact as g, megatron_adacc.optim as o\n"
            "assert 'torch' not in sys.modules\n"
            "assert c.build_reducer.__module__ == 'megatron_adacc.comm.pipeline' and 'torch' in sys.modules\n"
            "assert g.Controller.__name__ == 'Controller' and o.AdamA.__name__ == 'AdamA'\n"
            "try:\n    c.nothing\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "has no attribute 'nothing'" in out.stdout
