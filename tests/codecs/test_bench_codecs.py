"""``adacc bench codecs`` states the acceptance figure (issue 24, item 4) per codec and dtype: the round trip
against a copy measured in the same alternating rounds, printed in one table and kept in the results JSON."""

from __future__ import annotations

import json

from megatron_adacc import cli
from megatron_adacc.bench import harness
from megatron_adacc.core.tables import WIDTH


def test_bench_codecs_prints_and_records_the_round_trip_vs_copy_per_codec_and_dtype(tmp_path, capsys, monkeypatch):
    # The results file's machine and version sections are not what is tested here, and import half the world.
    monkeypatch.setattr(harness, "machine_info", dict)
    monkeypatch.setattr(harness, "versions", dict)
    argv = ["bench", "codecs", "--sizes-mb", "16", "--rounds", "1", "--threads", "1", "--device", "cpu",
            "--codecs", "int4_symmetric", "bitmask", "--dtype", "float32", "bfloat16", "--output-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    results = json.loads((tmp_path / "codecs.json").read_text())
    ratios = results["roundtrip_vs_copy"]["cpu"]["16MB"]
    assert set(ratios) == {"int4_symmetric", "bitmask"}
    assert set(ratios["int4_symmetric"]) == {"float32", "bfloat16"}
    assert set(ratios["bitmask"]) == {"bool"}  # measured once: it takes no float dtype
    for codec, per_dtype in ratios.items():
        for dtype, r in per_dtype.items():
            method = results["methods"][f"{codec}@16MB" + ("[bf16]" if dtype == "bfloat16" else
                                                             "[fp32]" if dtype == "float32" else "")]
            assert r["roundtrip_vs_copy"] == round(method["roundtrip_vs_copy"], 3) > 0
            assert r["meets_target"] == (method["roundtrip_vs_copy"] >= results["target_roundtrip_vs_copy"]["cpu"])
    out = capsys.readouterr().out
    table = out[out.index("cpu, 16MB:"):].splitlines()
    assert table[1].split() == ["codec", "fp32", "bf16"]
    assert table[3].startswith("int4_symmetric") and table[4].startswith("bitmask")
    assert table[5].startswith("below target: ")
    assert max(len(line) for line in table) <= WIDTH
