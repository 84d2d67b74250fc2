"""The ``transport`` section of ``adacc bench resireduce``: bytes each rank sends and receives per step.

For N = 2, 4, 8 gloo ranks (bytes do not depend on the machine, so 8 processes on 2 cores serve), one torchrun
launch per N trains the benchmark's model for two steps with each method: Megatron's own uncompressed reduction
(``megatron_allreduce``; ``megatron_reduce_scatter`` with the distributed optimizer) and ResiReduce's transports
(``allgather``, ``compressed_reduce_scatter``, and ``compressed_reduce_scatter_distopt`` under the distributed
optimizer), each compressor asked for. The bytes are counted by wrapping ``torch.distributed``'s collectives
(:mod:`megatron_adacc.testing.collectives`) while Megatron's DDP finishes the step's gradient reduction, so
Megatron's collectives and ours are counted the same way, none by the formula under test. A row's figure is the
busiest rank's (they differ by the shards' payload sizes).

Each method's measured bytes are fitted to ``a (N - 1) / N + b (N - 1)`` (the ring collectives' term and the
all-gather's), by least squares over the measured N, and the fit gives the rows at N = 64 and 512
(``measured: false``).
"""

from __future__ import annotations

import json
import sys

from megatron_adacc.bench import harness

#: Method -> (--resireduce-transport or None for Megatron's own, whether the distributed optimizer shards).
METHODS = {
    "megatron_allreduce": (None, False),
    "megatron_reduce_scatter": (None, True),
    "allgather": ("allgather", False),
    "compressed_reduce_scatter": ("reduce-scatter", False),
    "compressed_reduce_scatter_distopt": ("reduce-scatter", True),
}
EXTRAPOLATED = (64, 512)


def _flags(model: list[str], world: int, transport: str | None, distopt: bool, compressor: str,
           density: float) -> list[str]:
    flags = ["--device", "cpu", "--no-progress", "--train-iters", "2", "--lr", "3e-3", "--hidden-dropout", "0",
             "--attention-dropout", "0", *model, "--micro-batch-size", "1", "--global-batch-size", str(world)]
    if distopt:
        flags.append("--use-distributed-optimizer")
    if transport is None:
        return flags + ["--resireduce", "off"]
    return flags + ["--resireduce", "residual", "--grad-compressor", compressor, "--grad-compress-density",
                    str(density), "--resireduce-transport", transport]


def runs_for(model: list[str], world: int, compressors: list[str], density: float) -> list[dict]:
    """The runs of one launch of ``world`` ranks: Megatron's two methods once, ResiReduce's per compressor."""
    runs = []
    for method, (transport, distopt) in METHODS.items():
        for compressor in ([None] if transport is None else compressors):
            runs.append({"method": method, "compressor": compressor,
                         "flags": _flags(model, world, transport, distopt, compressor or "", density)})
    return runs


def measure(model: list[str], ranks: list[int], compressors: list[str], density: float, step) -> list[dict]:
    """Measured rows for every N in ``ranks``, then the extrapolated ones."""
    rows = []
    for world in ranks:
        step(f"bytes per rank at {world} ranks")
        out = harness.run_method_subprocess(__name__, {"runs": runs_for(model, world, compressors, density)},
                                            env={"OMP_NUM_THREADS": "1"}, timeout=3600, nproc=world)
        for run in out["runs"]:
            rows.append({"ranks": world, "method": run["method"], "compressor": run["compressor"],
                         "bytes_sent_per_rank": run["sent"], "bytes_received_per_rank": run["received"],
                         "measured": True})
    return rows + extrapolate(rows)


def fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``bytes = a (N - 1) / N + b (N - 1)`` over ``(N, bytes)`` points."""
    xs = [((n - 1) / n, n - 1.0) for n, _ in points]
    s11 = sum(x * x for x, _ in xs)
    s12 = sum(x * y for x, y in xs)
    s22 = sum(y * y for _, y in xs)
    t1 = sum(x * v for (x, _), (_, v) in zip(xs, points))
    t2 = sum(y * v for (_, y), (_, v) in zip(xs, points))
    det = s11 * s22 - s12 * s12
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


def extrapolate(rows: list[dict]) -> list[dict]:
    """Rows at N = 64 and 512 from each method's fit over its measured rows."""
    out = []
    for method, compressor in dict.fromkeys((r["method"], r["compressor"]) for r in rows):
        mine = [r for r in rows if (r["method"], r["compressor"]) == (method, compressor)]
        curves = {key: fit([(r["ranks"], r[key]) for r in mine])
                  for key in ("bytes_sent_per_rank", "bytes_received_per_rank")}
        for world in EXTRAPOLATED:
            row = {"ranks": world, "method": method, "compressor": compressor, "measured": False}
            for key, (a, b) in curves.items():
                row[key] = int(round(a * (world - 1) / world + b * (world - 1)))
            out.append(row)
    return out


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """A table: one line per method and compressor, bytes sent per rank at each N (received in the JSON)."""
    from megatron_adacc.core.units import format_bytes

    ranks = sorted({r["ranks"] for r in rows})
    head = ["method", "compressor", *(f"N={n}" + ("" if n in {r["ranks"] for r in rows if r["measured"]}
                                                   else " (fit)") for n in ranks)]
    lines = []
    for method, compressor in dict.fromkeys((r["method"], r["compressor"]) for r in rows):
        by_n = {r["ranks"]: r for r in rows if (r["method"], r["compressor"]) == (method, compressor)}
        lines.append([method.replace("compressed_reduce_scatter", "compressed_rs"), compressor or "-",
                      *(format_bytes(by_n[n]["bytes_sent_per_rank"]) for n in ranks)])
    return head, lines


def _child(payload_path: str) -> None:
    """One torchrun rank: every run in turn, counting the collectives of each step's gradient reduction."""
    import torch
    from megatron.core.distributed import DistributedDataParallel

    from megatron_adacc.comm.wire import Traffic
    from megatron_adacc.compat import quiet_fallback_warnings
    from megatron_adacc.core.patching import patch
    from megatron_adacc.testing.collectives import counting
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.loop import train

    quiet_fallback_warnings()
    steps: list = []

    def make(original):
        def finish_grad_sync(self, *args, **kwargs):
            with counting(Traffic()) as step:
                result = original(self, *args, **kwargs)
            steps.append(step.total)
            return result
        return finish_grad_sync

    patch(DistributedDataParallel, "finish_grad_sync", make, "the step's gradient reduction, counted")
    out = []
    for run in json.load(open(payload_path))["runs"]:
        steps.clear()
        train(parse_train_args(run["flags"]))
        if len(steps) != 2 or steps[0] != steps[1]:
            raise RuntimeError(f"{run['method']}: two steps moved {steps}; a step's bytes should not vary")
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, (steps[-1].sent, steps[-1].received))
        out.append({"method": run["method"], "compressor": run["compressor"],
                    "sent": max(s for s, _ in every), "received": max(r for _, r in every)})
    if torch.distributed.get_rank() == 0:
        sys.stdout.flush()
        print()
        print(json.dumps({"runs": out}))


if __name__ == "__main__":
    _child(sys.argv[1])
