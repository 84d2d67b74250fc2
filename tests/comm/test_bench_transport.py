"""The transport rows of `adacc bench resireduce`: the fit that extrapolates them and their table."""

from __future__ import annotations

import pytest

from megatron_adacc.bench import _resireduce_transport as bench_transport
from megatron_adacc.core.tables import WIDTH, format_table


def test_the_fit_recovers_the_ring_and_allgather_terms():
    rows = [{"ranks": n, "method": "m", "compressor": None, "measured": True,
             "bytes_sent_per_rank": 300 * (n - 1) / n + 7 * (n - 1),
             "bytes_received_per_rank": 300 * (n - 1) / n + 7 * (n - 1)} for n in (2, 4, 8)]
    a, b = bench_transport.fit([(r["ranks"], r["bytes_sent_per_rank"]) for r in rows])
    assert (a, b) == (pytest.approx(300), pytest.approx(7))
    far = {r["ranks"]: r for r in bench_transport.extrapolate(rows)}
    assert far[512]["bytes_sent_per_rank"] == round(300 * 511 / 512 + 7 * 511)
    assert not far[64]["measured"]


def test_the_transport_table_fits_the_terminal():
    rows = [{"ranks": n, "method": m, "compressor": c, "measured": n < 64, "bytes_sent_per_rank": 10**9,
             "bytes_received_per_rank": 1} for n in (2, 4, 8, 64, 512)
            for m, c in (("compressed_reduce_scatter_distopt", "topk"), ("megatron_reduce_scatter", None))]
    head, lines = bench_transport.table_rows(rows)
    assert max(map(len, format_table(head, lines).splitlines())) <= WIDTH
