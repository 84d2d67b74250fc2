"""`adacc bench gradients`: per-op gradient errors of the layer-specific codecs beside plain INT4."""

from __future__ import annotations

import json
from types import SimpleNamespace

from megatron_adacc.adacc.policy.ops import OP_NAMES
from megatron_adacc.bench import gradients


def test_every_op_is_measured_and_the_codecs_beat_plain_int4_where_the_paper_says_they_should(tmp_path) -> None:
    gradients.run(SimpleNamespace(seed=5, output_dir=str(tmp_path), quick=True))
    methods = json.loads((tmp_path / "gradients.json").read_text())["methods"]
    assert list(methods) == [*OP_NAMES, "all_ops"]
    # dropout's one-sided INT4 and the outlier-separated context are clearly more accurate than plain INT4
    assert methods["dropout"]["grad_rel_error"] < 0.5 * methods["dropout"]["plain_int4_grad_rel_error"]
    assert methods["context"]["grad_rel_error"] < methods["context"]["plain_int4_grad_rel_error"]
    # and the whole layer compressed with them errs less than quantize-all, yet not zero
    whole = methods["all_ops"]
    assert 0 < whole["grad_rel_error"] < whole["plain_int4_grad_rel_error"]
