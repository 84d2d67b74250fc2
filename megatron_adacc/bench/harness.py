"""The benchmark convention every `adacc bench NAME` follows.

* ``megatron_adacc/bench/NAME.py`` defines ``add_arguments(parser)`` and ``run(args) -> dict``; it is found by
  name, so adding a benchmark touches no other file.
* Methods run side by side in one invocation; where memory is measured each method runs in its own
  subprocess (:func:`run_method_subprocess`), so one method's allocator state cannot leak into another's.
* Results: a table with ratios to a baseline (:func:`print_table`) and ``benchmarks/results/NAME.json``
  (:func:`write_results`) holding ``machine``, ``versions``, ``config`` and ``methods: {name: {metric: v}}``
  with the shared metric names below, plus a PNG where a curve says more.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import pkgutil
import platform
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from megatron_adacc.core.log import echo, get_logger
from megatron_adacc.core.tables import WIDTH, format_table

LOG = get_logger("bench")
REPO_ROOT = Path(__file__).resolve().parents[2]

METRICS = (
    "step_time_s", "tokens_per_s", "peak_memory_bytes", "saved_activation_bytes", "final_loss",
    "compress_gbps", "decompress_gbps", "copy_gbps", "compression_ratio",
)
#: Metrics where smaller is better; the table's ratio column reads "x slower / x larger" for these.
LOWER_IS_BETTER = {"step_time_s", "peak_memory_bytes", "saved_activation_bytes", "final_loss"}

_NOT_BENCHMARKS = {"harness", "common", "megatron_lm_logs", "outliers", "evolution", "seeds"}


def available_benchmarks() -> list[str]:
    import megatron_adacc.bench as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name not in _NOT_BENCHMARKS
                  and not m.name.startswith("_"))


def machine_info() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    try:
        info["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    else:
        info["gpu"] = None
    return info


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        from megatron_adacc.compat import megatron_version

        out["megatron_core"] = megatron_version()
    except Exception:  # noqa: BLE001 - a benchmark without megatron still reports
        out["megatron_core"] = None
    from megatron_adacc import __version__

    out["megatron_adacc"] = __version__
    try:
        from megatron_adacc import codecs

        out["codec_backend"] = codecs.backend()
    except Exception:  # noqa: BLE001
        pass
    return out


def results_dir(args=None) -> Path:
    """``benchmarks/results``, or ``benchmarks/results/quick`` for ``--quick`` runs, so that a CI-sized run
    never overwrites the recorded full results; under ``benchmarks/results/ATTENTION`` for a bench run with
    another ``--attention`` than the config's. ``--output-dir`` overrides them. ``benchmarks/`` is the
    checkout's when running from one (the recorded results live there), else the current directory's: an
    installed package never writes into site-packages."""
    root = REPO_ROOT if (REPO_ROOT / "pyproject.toml").is_file() else Path.cwd()
    recorded = root / "benchmarks" / "results"
    attention = getattr(args, "attention", None)
    if attention not in (None, "config"):
        recorded = recorded / attention
    default = recorded / "quick" if getattr(args, "quick", False) else recorded
    out = Path(getattr(args, "output_dir", None) or default)
    out.mkdir(parents=True, exist_ok=True)
    return out


def pyplot():
    """matplotlib's pyplot drawing to files, or None (after one line saying how to get the plots): matplotlib
    is an optional dependency, and a benchmark's tables and JSON do not need it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no plots: pip install 'megatron-adacc[plots]'")
        return None
    return plt


def write_results(name: str, config: dict, methods: dict, extra: dict | None = None, args=None) -> Path:
    """Write ``benchmarks/results/NAME.json`` in the common format and return its path."""
    payload = {"benchmark": name, "machine": machine_info(), "versions": versions(), "config": config,
               "methods": methods}
    if extra:
        payload.update(extra)
    path = results_dir(args) / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=_jsonable))
    LOG.info("wrote %s", path)
    return path


def update_results(name: str, sections: dict, args=None) -> Path:
    """Replace top-level ``sections`` of ``benchmarks/results/NAME.json``, keeping the rest (a section measured
    alone, where the machine does not matter: bytes); the machine it was measured on is kept beside it."""
    path = results_dir(args) / f"{name}.json"
    payload = json.loads(path.read_text()) if path.is_file() else {"benchmark": name, "methods": {}}
    payload.update(sections)
    payload.setdefault("measured_separately", {}).update({key: machine_info() for key in sections})
    path.write_text(json.dumps(payload, indent=2, default=_jsonable))
    LOG.info("wrote %s", path)
    return path


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


#: Column heads of the shared metrics (the JSON keeps the metric names); others read as their name.
LABELS = {"step_time_s": "step time", "tokens_per_s": "tokens/s", "peak_memory_bytes": "peak memory",
          "saved_activation_bytes": "held for backward", "final_loss": "final loss", "compress_gbps": "compress GB/s",
          "decompress_gbps": "decompress GB/s", "copy_gbps": "copy GB/s", "compression_ratio": "compression ratio"}


def label(metric: str) -> str:
    """A metric's column head: :data:`LABELS`, else its name in words without the unit suffix."""
    if metric in LABELS:
        return LABELS[metric]
    for suffix in ("_bytes", "_s"):
        if metric.endswith(suffix):
            metric = metric[:-len(suffix)]
    return metric.replace("_", " ")


def _fmt(metric: str, value) -> str:
    if value is None:
        return "-"
    if metric.endswith("_bytes") and isinstance(value, (int, float)):
        from megatron_adacc.core.units import format_bytes

        return format_bytes(value)
    if metric.endswith("_s") and not metric.endswith("per_s") and isinstance(value, (int, float)):
        return f"{value * 1e3:.1f} ms" if value >= 0.01 else f"{value * 1e3:.3f} ms"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_table(methods: dict, baseline: str | None = None, metrics: list[str] | None = None,
                title: str | None = None) -> str:
    """Print (and return) a table of ``methods`` with each metric's ratio to ``baseline``, at most 100 columns
    wide (:func:`~megatron_adacc.core.tables.format_table`)."""
    metrics = metrics or [m for m in METRICS if any(m in v for v in methods.values())]
    base = methods.get(baseline, {}) if baseline else {}
    rows = []
    for name, values in methods.items():
        row = [name]
        for m in metrics:
            v = values.get(m)
            cell = _fmt(m, v)
            b = base.get(m)
            if baseline and isinstance(v, (int, float)) and isinstance(b, (int, float)) and b:
                cell += f" ({v / b:.2f}x)"
            row.append(cell)
        rows.append(row)
    head = textwrap.wrap((title or "") + (f" (in brackets: the ratio to {baseline})" if baseline else ""), WIDTH)
    text = "\n".join(head + [""] * bool(head) + [format_table(["method", *map(label, metrics)], rows)])
    echo(text)
    return text


def run_method_subprocess(module: str, payload: dict, env: dict | None = None, timeout: float = 1800,
                          low_fragmentation_malloc: bool = False, nproc: int = 1) -> dict:
    """Run ``python -m module`` with ``payload`` as JSON in a fresh process; return the JSON it prints last.

    The child reads the payload path from argv[1] and must print one JSON object as its last stdout line.
    ``low_fragmentation_malloc`` sets ``MALLOC_MMAP_THRESHOLD_=65536`` so that peak RSS follows live memory
    (glibc otherwise keeps freed activation buffers; see docs/measuring.md). Use it for memory runs only:
    it slows large allocations. ``nproc > 1`` launches the module under torchrun on 127.0.0.1 (rank 0 prints).
    """
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(payload, fh)
        path = fh.name
    child_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if low_fragmentation_malloc:
        child_env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    child_env.update(env or {})
    try:
        launcher = [sys.executable]
        if nproc > 1:
            from megatron_adacc.training.distributed import free_port

            child_env.setdefault("OMP_NUM_THREADS", "1")
            launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
                         f"--master_port={free_port()}"]
        proc = subprocess.run([*launcher, "-m", module, path], capture_output=True, text=True,
                              timeout=timeout, env=child_env)
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not last:
        raise RuntimeError(f"{module} printed no JSON result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(last[-1])
