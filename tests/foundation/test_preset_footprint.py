"""A run with a preset or a policy file loads no solver: PuLP (with the HiGHS library it imports) and sqlite3 are
about 5 MiB of resident memory, which on the CPU counts against the budget (peak RSS) of a run that never solves.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

_CODE = """
import sys
from megatron_adacc.adacc.integration.extension import build_extensions
from megatron_adacc.testing import tiny_config
from megatron_adacc.training.args import parse_train_args

spec = sys.argv[1]
if spec == "file":
    from megatron_adacc.adacc.policy import Policy, save_policy
    spec = str(save_policy(Policy.all_recompute(2), sys.argv[2] + "/p.json"))
extensions = build_extensions(parse_train_args(["--adacc-policy", spec]), tiny_config())
print([e.name for e in extensions], sorted(m for m in ("pulp", "highspy", "sqlite3") if m in sys.modules))
"""


@pytest.mark.parametrize("policy", ["recompute", "file"])
def test_a_run_that_never_solves_imports_no_solver(policy, tmp_path) -> None:
    out = subprocess.run([sys.executable, "-c", _CODE, policy, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['adacc'] []"
