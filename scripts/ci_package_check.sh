#!/usr/bin/env bash
# CI: the package as a user gets it, outside the checkout.
#
#   scripts/ci_package_check.sh
#
# 1. `python -m build --sdist` (isolated: an sdist needs no torch), and the sdist holds every source, header,
#    CUDA kernel, config and the in-tree build backend;
# 2. a wheel built from that sdist the way `pip install .` builds one (pip's default isolation, compiled against
#    the torch already installed), installed into an environment that is not the checkout's;
# 3. `adacc train --train-iters 2` from another directory, the configs read from the wheel, bench results
#    outside site-packages, the compiled codecs and py.typed installed;
# 4. a build where no torch is installed stops with the message that says what to do.
#
# The environment (torch 2.13.0 CPU and the runtime dependencies) lives outside the clone, keyed by its pins and
# Python (~/.cache/megatron-adacc/pkg-<hash>), so a second run reuses it; the wheel is built and installed afresh
# every run. PYTHON picks the interpreter (default: python3.11, as `make test`, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# A pyenv shim may exist and still refuse to run (another version selected), so each candidate is tried.
for PYTHON in ${PYTHON:-} python3.11 python3; do
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null && break
done
PINS="torch==2.13.0 megatron-core==0.16.1 pulp highspy numpy packaging tqdm setuptools>=77 build"
HASH=$({ printf '%s' "$PINS"; "$PYTHON" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-12)
VENV=${ADACC_PKG_VENV:-$HOME/.cache/megatron-adacc/pkg-$HASH}
PY=$VENV/bin/python
# pip's extra-index-url on some machines names folders that do not exist; its notice about each is noise.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
step() { printf '[package] %s (%ds)\n' "$1" "$SECONDS"; }

if [ ! -f "$VENV/.complete" ]; then
  step "creating $VENV"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  [ -n "${ADACC_PKG_VENV:-}" ] || find "$(dirname "$VENV")" -maxdepth 1 -name 'pkg-*' -exec rm -rf {} +
  "$PYTHON" -m venv "$VENV"
  # shellcheck disable=SC2086 # one pin per word
  quiet "$PY" -m pip install -q --disable-pip-version-check $PINS
  touch "$VENV/.complete"
fi

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/dist" "$TMP/run"

step "sdist (python -m build --sdist, isolated)"
quiet "$PY" -m build --sdist --outdir "$TMP/dist" "$ROOT" >"$TMP/sdist.log" 2>&1 || { cat "$TMP/sdist.log"; exit 1; }
SDIST=$(ls "$TMP"/dist/*.tar.gz)
"$PY" - "$SDIST" "$ROOT" <<'PY'
import sys, tarfile
from pathlib import Path

sdist, root = sys.argv[1], Path(sys.argv[2])
with tarfile.open(sdist) as tar:
    names = {"/".join(n.split("/")[1:]) for n in tar.getnames()}
wanted = [str(p.relative_to(root)) for pattern in ("csrc/**/*.cpp", "csrc/**/*.h", "csrc/cuda/*.cu", "configs/*.toml",
                                                  "build_backend/*.py", "megatron_adacc/**/*.py")
          for p in sorted(root.glob(pattern))]
wanted += ["megatron_adacc/py.typed", "pyproject.toml", "setup.py", "LICENSE", "README.md"]
missing = [w for w in wanted if w not in names]
stray = sorted(n for n in names if n.endswith((".so", ".o", ".pyc")))
if missing or stray:
    sys.exit(f"sdist {sdist}: missing {missing}, compiled files {stray}")
print(f"[package] sdist holds all {len(wanted)} sources, headers, kernels and configs")
PY

step "wheel from the sdist (pip's isolated build, against the installed torch)"
quiet "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir "$TMP/dist" "$SDIST" \
  >"$TMP/wheel.log" 2>&1 || { cat "$TMP/wheel.log"; exit 1; }
WHEEL=$(ls "$TMP"/dist/*.whl)
echo "[package] $(basename "$WHEEL")"

step "install the wheel"
quiet "$PY" -m pip uninstall -q -y megatron-adacc >/dev/null 2>&1 || true
quiet "$PY" -m pip install -q --disable-pip-version-check "$WHEEL"
quiet "$PY" -m pip check >/dev/null

step "adacc train --train-iters 2 from another directory"
cd "$TMP/run"
"$VENV/bin/adacc" train --train-iters 2 --no-progress --output-json "$TMP/run/summary.json" >"$TMP/train.log" 2>&1 ||
  { cat "$TMP/train.log"; exit 1; }
"$PY" -m megatron_adacc.megatron_lm.configs gpt-345m >/dev/null
"$PY" - <<'PY'
import json
import sysconfig
from pathlib import Path

import megatron_adacc
from megatron_adacc import codecs
from megatron_adacc.bench import harness
from megatron_adacc.core import config_files

package = Path(megatron_adacc.__file__).parent
site = Path(sysconfig.get_path("purelib"))
assert package.is_relative_to(site), f"megatron_adacc imported from {package}, not the installed wheel"
assert codecs.backend() == "cpp", f"codec backend {codecs.backend()!r}: the compiled extension did not load"
assert config_files.config_dir() == package / "configs", config_files.config_dir()
assert (package / "py.typed").is_file()
assert json.loads(Path("summary.json").read_text())["iterations"] == 2
results = harness.results_dir()
assert results == Path.cwd() / "benchmarks" / "results" and not results.is_relative_to(site), results
print(f"[package] installed at {package}: compiled codecs, configs and py.typed from the wheel")
PY
cd "$ROOT"

step "a build without torch says what to do"
"$PYTHON" -m venv --without-pip "$TMP/bare"
if quiet "$PY" -m pip --python "$TMP/bare/bin/python" wheel -q --disable-pip-version-check --no-deps \
    --wheel-dir "$TMP/bare-dist" "$SDIST" >"$TMP/bare.log" 2>&1; then
  echo "a build without torch succeeded" >&2; exit 1
fi
grep -q "Install torch first" "$TMP/bare.log" || { cat "$TMP/bare.log"; exit 1; }

step "package check passed"
