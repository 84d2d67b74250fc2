#!/usr/bin/env bash
# CI: Adacc's solver and `--adacc-policy auto` on Python 3.12 with what pip resolves there: PuLP 4, which bundles
# no CBC, with highspy, and megatron-core 0.19.2 (the environment of scripts/megatron_lm_env312.sh, shared with
# the Megatron-LM tier, so this adds no install time).
#
#   scripts/ci_python312_check.sh
#
# 1. HiGHS is the backend the package picks there;
# 2. the MILP strategies equal exhaustive search on it (tests/policy/test_milp.py);
# 3. `adacc solve` writes a policy that names the backend that solved it;
# 4. `adacc train --adacc-policy auto --train-iters 5` solves and trains, from another directory (on the profile
#    step 3 measured, in a database of this run's own).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '[py312] %s (%ds)\n' "$1" "$SECONDS"; }

step "environment (scripts/megatron_lm_env312.sh)"
PY=$(scripts/megatron_lm_env312.sh)
BIN=$(dirname "$PY")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" - <<'PY'
import sys

import pulp

from megatron_adacc.adacc.policy.strategies.base import available_backends, select_backend

assert sys.version_info[:2] == (3, 12), sys.version
assert int(pulp.__version__.split(".")[0]) >= 4, f"PuLP {pulp.__version__}: this check is for PuLP 4, pip's pick on 3.12"
assert select_backend() == "highs", available_backends()
print(f"[py312] Python {sys.version.split()[0]}, PuLP {pulp.__version__}, MILP backends {available_backends()}")
PY

step "MILP strategies against exhaustive search"
"$PY" -m pytest tests/policy/test_milp.py -q -p no:cacheprovider --timeout 600

cd "$TMP"
# On the CPU the budget is the whole process's peak RSS (interpreter and libraries included).
step "adacc solve"
"$BIN/adacc" solve --config tiny --adacc-memory-budget 4GiB --adacc-profile-db "$TMP/profile.sqlite" -o policy.json \
  >solve.log 2>&1 || { cat solve.log; exit 1; }
"$PY" - <<'PY'
import json

solver = json.load(open("policy.json"))["solver"]
assert solver["backend"] == "highs" and solver["status"] in ("Optimal", "Feasible"), solver
print(f"[py312] policy solved by {solver['strategy']} on {solver['backend']} in {solver['solve_time_s'] * 1e3:.0f} ms")
PY

step "adacc train --adacc-policy auto --train-iters 5"
"$BIN/adacc" train --adacc-policy auto --train-iters 5 --adacc-profile-db "$TMP/profile.sqlite" --no-progress \
  --output-json summary.json >train.log 2>&1 || { cat train.log; exit 1; }
"$PY" - <<'PY'
import json

summary = json.load(open("summary.json"))
assert summary["iterations"] == 5 and summary["extensions"]["adacc"]["policy"] == "adacc", summary
print(f"[py312] auto trained 5 iterations: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}")
PY
step "Python 3.12 check passed"
