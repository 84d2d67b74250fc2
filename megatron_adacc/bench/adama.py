"""AdamA against Adam with gradient accumulation on a megatron-core GPT, at N = 1, 2, 4, 8 micro-batches.

Methods (both train the same GPT from the same weights on the same batches, Megatron's loop shape):

* ``adam_accumulation``: megatron-core DDP (persistent fp32 gradient buffer) + Megatron's Adam optimizer.
* ``adama``: ``setup_adama`` (no DDP buffer; gradients folded into m and v during backward and freed).

The model is chosen so gradients are a large share of memory (short sequences, small micro-batches: few
activations, many parameters). Figures come from three kinds of child processes:

* memory: one process per (method, N) with ``MALLOC_MMAP_THRESHOLD_=65536`` so peak RSS follows live memory
  (see /work/shared/research/measuring-on-cpu.md); also reports the gradient bytes held, counted exactly
  (persistent DDP buffer + peak of simultaneously alive ``.grad`` tensors, via weak references);
* time: one default-allocator process per N that alternates the two methods step by step on identical
  batches (machine noise hits both alike) and reports median step times;
* loss curves: the same alternating process over more steps at one N, plotted to
  ``benchmarks/results/adama.png``.

With the distributed optimizer, at each data-parallel size of ``--dp-sizes`` (gloo ranks, bf16, ``N`` micro-batches
per rank):

* ``megatron_distributed_optimizer``: Megatron's DDP + distributed optimizer with gradient accumulation;
* ``adama_distributed``: ``--adama --use-distributed-optimizer``.

Each rank reports its peak RSS (one torchrun job per method, ``MALLOC_MMAP_THRESHOLD_=65536``), its optimizer
state bytes, its persistent gradient buffer and the gradient bytes it held at most; step times come from one job
that alternates the two methods step by step (not in ``--quick``). 2 and 4 processes on 2 cores measure bytes
honestly but not time: time them on a machine with a core per rank.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import textwrap
import time

import torch

from megatron_adacc.bench import harness
from megatron_adacc.core.devices import peak_resident_bytes, resident_bytes
from megatron_adacc.core.log import Steps, echo
from megatron_adacc.core.tables import WIDTH

METHODS = ("adam_accumulation", "adama")
#: With Megatron's distributed optimizer: the baseline first.
DISTRIBUTED_METHODS = ("megatron_distributed_optimizer", "adama_distributed")
#: Methods that train with AdamA (the others with Megatron's DDP and optimizer).
_ADAMA = {"adama", "adama_distributed"}
#: Elements per gradient bucket of the distributed rows: about 1/12 of each model, as a real run's buckets are.
DP_BUCKET_SIZE = {"full": 1_000_000, "quick": 150_000}

MODEL_FLAGS = {
    "full": ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--ffn-hidden-size",
             "2048", "--seq-length", "64", "--micro-batch-size", "2"],
    "quick": ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size",
              "1024", "--seq-length", "32", "--micro-batch-size", "2"],
}
COMMON_FLAGS = ["--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "0", "--lr", "1e-3",
                "--min-lr", "1e-3", "--weight-decay", "0.01", "--seed", "1234", "--device", "cpu"]


def add_arguments(parser) -> None:
    parser.add_argument("--microbatches", type=int, nargs="*", default=None,
                        help="Values of N to measure in one process (default 1 2 4 8; quick: 1 4; none: only the "
                             "distributed-optimizer rows).")
    parser.add_argument("--steps", type=int, default=None,
                        help="Timed steps per method and N; the first is warm-up (default 10; quick 8).")
    parser.add_argument("--curve-steps", type=int, default=None,
                        help="Steps of the loss-curve run (default 40; quick 20).")
    parser.add_argument("--curve-microbatches", type=int, default=4, help="N of the loss-curve run.")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="Sequences per micro-batch (default 2: gradients dominate memory; larger values "
                             "add compute per micro-batch, against which AdamA's folding cost shrinks).")
    parser.add_argument("--dp-sizes", type=int, nargs="*", default=None,
                        help="Data-parallel sizes of the distributed-optimizer rows (default 2 4; quick: 2; none: "
                             "skip them).")
    parser.add_argument("--dp-microbatches", type=int, default=4,
                        help="Micro-batches per rank and step in the distributed-optimizer rows.")


# --------------------------------------------------------------------------- parent


def run(args) -> dict:
    size = "quick" if args.quick else "full"
    ns = ([1, 4] if args.quick else [1, 2, 4, 8]) if args.microbatches is None else args.microbatches
    steps = args.steps or (8 if args.quick else 10)
    curve_steps = args.curve_steps or (20 if args.quick else 40)
    flags = MODEL_FLAGS[size] + COMMON_FLAGS
    if args.micro_batch_size:
        flags += ["--micro-batch-size", str(args.micro_batch_size)]
    # Quick mode measures memory at the largest N only: every child pays megatron's import (seconds).
    memory_ns = ns[-1:] if args.quick else ns
    dp_sizes = ([2] if args.quick else [2, 4]) if args.dp_sizes is None else args.dp_sizes
    jobs_per_dp = len(DISTRIBUTED_METHODS) + (0 if args.quick else 1)
    step = Steps(bool(ns) + len(memory_ns) * len(METHODS) + len(dp_sizes) * jobs_per_dp, "adama")
    methods, curves = _single_process_rows(args, flags, ns, memory_ns, steps, curve_steps, step) if ns else ({}, {})
    distributed = {dp: _distributed_runs(args, size, dp, step) for dp in dp_sizes}
    step.close()
    for n in ns:
        harness.print_table({m: methods[f"{m}_n{n}"] for m in METHODS}, baseline="adam_accumulation",
                            metrics=["step_time_s", "step_time_min_s", "tokens_per_s", "peak_memory_bytes",
                                     "training_memory_bytes", "gradient_held_bytes", "final_loss"],
                            title=f"N = {n} micro-batches ({size} model)")
        echo()
    summary = _summary(methods, ns, memory_ns, curves) if ns else {"figures": {}, "lines": []}
    for dp, runs in distributed.items():
        rows = {m: _distributed_row(runs, m) for m in DISTRIBUTED_METHODS}
        methods.update({f"{m}_dp{dp}": row for m, row in rows.items()})
        harness.print_table(rows, baseline=DISTRIBUTED_METHODS[0], metrics=DISTRIBUTED_METRICS,
                            title=f"DP = {dp}, N = {args.dp_microbatches} micro-batches per rank, bf16 ({size} model), "
                                  "per rank (the largest over ranks)")
        echo()
        _distributed_summary(rows, dp, summary)
    for line in summary["lines"]:
        echo(textwrap.fill(line, WIDTH, subsequent_indent="    "))
    config = {"model_flags": flags, "microbatches": ns, "memory_microbatches": memory_ns, "steps": steps,
              "curve_steps": curve_steps, "curve_microbatches": args.curve_microbatches, "quick": args.quick,
              "time_runs": "default allocator, methods alternated step by step in one process, median of "
                           "steps after the first",
              "memory_runs": "one process per method and N, MALLOC_MMAP_THRESHOLD_=65536",
              "dp_sizes": dp_sizes, "dp_microbatches": args.dp_microbatches,
              "dp_flags": {dp: _distributed_flags(args, size, dp) for dp in dp_sizes},
              "dp_runs": "gloo ranks under torchrun, bf16; memory: one job per method and DP size "
                         "(MALLOC_MMAP_THRESHOLD_=65536), the largest peak over ranks; time: one job alternating "
                         "the methods step by step (not in --quick)"}
    harness.write_results("adama", config, methods,
                          extra={"loss_curves": curves, "summary": summary["figures"]}, args=args)
    if ns:
        _plot(methods, memory_ns, curves, args)
    return methods


def _single_process_rows(args, flags: list[str], ns: list[int], memory_ns: list[int], steps: int,
                         curve_steps: int, step) -> tuple[dict, dict]:
    """Adam with accumulation and AdamA in one process at each N: times (alternating), memory, loss curves."""
    step(f"timing both methods, alternating, at N = {ns}; loss curves over {curve_steps} steps at "
         f"N={args.curve_microbatches}")
    timed = harness.run_method_subprocess(__name__, {
        "mode": "time", "flags": flags,
        "runs": [[n, steps] for n in ns] + [[args.curve_microbatches, curve_steps]]})
    memory = {}
    for n in memory_ns:
        for method in METHODS:
            step(f"N={n}: memory of {method}")
            memory[method, n] = harness.run_method_subprocess(
                __name__, {"mode": "memory", "flags": flags, "n": n, "method": method, "steps": 2},
                low_fragmentation_malloc=True)
    methods: dict[str, dict] = {}
    for i, n in enumerate(ns):
        for method in METHODS:
            t = timed["runs"][i][method]
            entry = {"num_microbatches": n, "step_time_s": t["step_time_s"],
                     "step_time_min_s": min(t["step_times_s"][1:] or t["step_times_s"]),
                     "step_times_s": t["step_times_s"],
                     "tokens_per_s": timed["runs"][i]["tokens_per_step"] / t["step_time_s"],
                     "final_loss": t["losses"][-1]}
            mem = memory.get((method, n))
            if mem is not None:
                entry.update({
                    "peak_memory_bytes": mem["peak_memory_bytes"],
                    "peak_memory_source": "peak RSS of a MALLOC_MMAP_THRESHOLD_=65536 run",
                    "training_memory_bytes": mem["peak_memory_bytes"] - mem["rss_before_training_bytes"],
                    "gradient_held_bytes": mem["gradient_held_bytes"],
                    "optimizer_state_bytes": mem["optimizer_state_bytes"],
                    "param_bytes": mem["param_bytes"],
                })
            methods[f"{method}_n{n}"] = entry
    curve = timed["runs"][-1]
    return methods, {m: curve[m]["losses"] for m in METHODS}


#: The distributed rows' columns.
DISTRIBUTED_METRICS = ["peak_memory_bytes", "training_memory_bytes", "optimizer_state_bytes",
                       "gradient_buffer_bytes", "gradient_held_bytes", "step_time_s", "final_loss"]


def _distributed_flags(args, size: str, dp: int) -> list[str]:
    n = args.dp_microbatches
    micro = args.micro_batch_size or 2
    return (MODEL_FLAGS[size] + COMMON_FLAGS + (["--micro-batch-size", str(micro)] if args.micro_batch_size else [])
            + ["--bf16", "--ddp-bucket-size", str(DP_BUCKET_SIZE[size]), "--global-batch-size", str(micro * n * dp)])


def _distributed_runs(args, size: str, dp: int, step) -> dict:
    """Both methods at data-parallel size ``dp``: a memory job each, and (not in quick mode) a time job."""
    flags = _distributed_flags(args, size, dp)
    runs: dict = {}
    for method in DISTRIBUTED_METHODS:
        step(f"DP={dp}: memory of {method} ({dp} ranks)")
        runs[method] = harness.run_method_subprocess(
            __name__, {"mode": "distributed", "flags": flags, "method": method, "n": args.dp_microbatches,
                       "steps": 2}, low_fragmentation_malloc=True, nproc=dp)
    if not args.quick:
        step(f"DP={dp}: timing both methods, alternating ({dp} ranks)")
        runs["time"] = harness.run_method_subprocess(
            __name__, {"mode": "distributed", "flags": flags, "n": args.dp_microbatches,
                       "steps": args.steps or 10}, nproc=dp)
    return runs


def _distributed_row(runs: dict, method: str) -> dict:
    ranks = runs[method]["ranks"]
    peaks = [r["peak_memory_bytes"] for r in ranks]
    row = {"data_parallel_size": len(ranks), "peak_memory_bytes": max(peaks), "peak_memory_bytes_per_rank": peaks,
           "peak_memory_source": "peak RSS of a MALLOC_MMAP_THRESHOLD_=65536 run, the largest over ranks",
           "training_memory_bytes": max(r["peak_memory_bytes"] - r["rss_before_training_bytes"] for r in ranks),
           **{k: max(r[k] for r in ranks) for k in ("optimizer_state_bytes", "gradient_buffer_bytes",
                                                   "gradient_held_bytes", "param_bytes")},
           "final_loss": ranks[0]["losses"][-1]}
    timed = runs.get("time", {}).get(method)
    if timed is not None:
        row.update({"step_time_s": timed["step_time_s"], "step_times_s": timed["step_times_s"],
                    "final_loss": timed["losses"][-1]})
    return row


def _distributed_summary(rows: dict, dp: int, summary: dict) -> None:
    base, ours = (rows[m] for m in DISTRIBUTED_METHODS)
    saved = base["peak_memory_bytes"] - ours["peak_memory_bytes"]
    fig = {"peak_memory_saving_bytes": saved, "peak_memory_saving_fraction": saved / base["peak_memory_bytes"],
           "optimizer_state_ratio": ours["optimizer_state_bytes"] / base["optimizer_state_bytes"],
           "gradient_held_ratio": ours["gradient_held_bytes"] / base["gradient_held_bytes"],
           "below_megatron": saved > 0}
    if "step_time_s" in base and "step_time_s" in ours:
        fig["step_time_ratio"] = ours["step_time_s"] / base["step_time_s"]
    summary["figures"][f"dp{dp}"] = fig
    summary["lines"].append(
        f"  DP={dp}: AdamA + distributed optimizer peaks {_mib(saved)} ({fig['peak_memory_saving_fraction']:.1%}) "
        f"{'below' if saved > 0 else 'ABOVE'} Megatron's distributed optimizer per rank; optimizer state "
        f"{fig['optimizer_state_ratio']:.2f}x, gradient bytes held {_mib(base['gradient_held_bytes'])} -> "
        f"{_mib(ours['gradient_held_bytes'])}"
        + (f", step time {fig['step_time_ratio']:.2f}x (2 cores: not a timing)" if "step_time_ratio" in fig else ""))


def _summary(methods: dict, ns: list[int], memory_ns: list[int], curves: dict) -> dict:
    figures, lines = {}, ["AdamA vs Adam with gradient accumulation:"]
    for n in ns:
        a, b = methods[f"adam_accumulation_n{n}"], methods[f"adama_n{n}"]
        if n not in memory_ns:
            change = b["tokens_per_s"] / a["tokens_per_s"] - 1
            ratio_min = b["step_time_min_s"] / a["step_time_min_s"]
            figures[f"n{n}"] = {"throughput_change": change, "step_time_ratio_min": ratio_min}
            lines.append(f"  N={n}: throughput {change:+.1%} (median; best-step time ratio {ratio_min:.3f}); "
                         "memory not measured in quick mode")
            continue
        saved = a["peak_memory_bytes"] - b["peak_memory_bytes"]
        fig = {
            "step_time_ratio_min": b["step_time_min_s"] / a["step_time_min_s"],
            "peak_memory_saving_bytes": saved,
            "peak_memory_saving_fraction": saved / a["peak_memory_bytes"],
            "training_memory_saving_fraction": (a["training_memory_bytes"] - b["training_memory_bytes"])
            / a["training_memory_bytes"],
            "saving_over_gradient_buffer": saved / b["param_bytes"],
            "throughput_change": b["tokens_per_s"] / a["tokens_per_s"] - 1,
        }
        figures[f"n{n}"] = fig
        lines.append(
            f"  N={n}: peak RSS -{_mib(saved)} ({fig['peak_memory_saving_fraction']:.1%}; "
            f"{fig['saving_over_gradient_buffer']:.2f}x the gradient buffer of {_mib(b['param_bytes'])}), "
            f"memory above the model-built baseline -{fig['training_memory_saving_fraction']:.1%}, "
            f"gradient bytes held {_mib(a['gradient_held_bytes'])} -> {_mib(b['gradient_held_bytes'])}, "
            f"throughput {fig['throughput_change']:+.1%} (median; best-step time ratio "
            f"{fig['step_time_ratio_min']:.3f})")
    diffs = [abs(x - y) for x, y in zip(curves["adam_accumulation"], curves["adama"])]
    figures["loss_curve_max_abs_diff"] = max(diffs)
    lines.append(f"  loss curves ({len(diffs)} steps): max |difference| {max(diffs):.4f}, final "
                 f"{curves['adam_accumulation'][-1]:.4f} vs {curves['adama'][-1]:.4f}")
    return {"figures": figures, "lines": lines}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _plot(methods: dict, ns: list[int], curves: dict, args) -> None:
    plt = harness.pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for m, style in zip(METHODS, ("-", "--")):
        ax1.plot(range(1, len(curves[m]) + 1), curves[m], style, label=m)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_title(f"loss, N={args.curve_microbatches} micro-batches, same batches")
    ax1.legend()
    width = 0.38
    for i, m in enumerate(METHODS):
        ax2.bar([j + (i - 0.5) * width for j in range(len(ns))],
                [methods[f"{m}_n{n}"]["peak_memory_bytes"] / 2**20 for n in ns], width, label=m)
    ax2.set_xticks(range(len(ns)), [f"N={n}" for n in ns])
    ax2.set_ylabel("peak RSS (MiB, low-fragmentation malloc)")
    ax2.set_title("peak memory")
    ax2.legend(loc="lower right")
    fig.tight_layout()
    path = harness.results_dir(args) / "adama.png"
    fig.savefig(path, dpi=110)
    harness.LOG.info("wrote %s", path)


# ----------------------------------------------------------------------- measures


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state this rank holds: Adam's moments and the fp32 master weights, of a Megatron
    optimizer (chained, distributed or not) or of AdamA's (replicated or sharded)."""
    inner = getattr(optimizer, "optimizer", None)
    if hasattr(inner, "state_bytes"):  # AdamA's
        return inner.state_bytes()
    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(opt, "optimizer", opt)
        tensors = [t for state in torch_opt.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
        for masters in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            tensors += [t for group in getattr(opt, masters, []) for t in group]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def gradient_buffer_bytes(chunk) -> int:
    """Bytes of Megatron DDP's persistent gradient buffers behind ``chunk`` (0 for AdamA's stand-ins)."""
    buffers = getattr(chunk, "buffers", None)
    if not isinstance(buffers, list):  # a bare module: Module.buffers() is its registered buffers
        return 0
    return sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)


# ---------------------------------------------------------------------------- child


class _Trainer:
    """One method's model and optimizer, stepping exactly like `adacc train`'s loop."""

    def __init__(self, method: str, args, config, n: int) -> None:
        from types import SimpleNamespace

        from megatron_adacc.optim.meter import LiveGradientMeter
        from megatron_adacc.training import distributed
        from megatron_adacc.training import model as model_lib

        args = SimpleNamespace(**{**vars(args), "use_distributed_optimizer": method in DISTRIBUTED_METHODS})
        distributed.set_seed(args.seed)
        self.model = model_lib.build_gpt(args, config)
        self.n = n
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # Registered before AdamA's hooks, so it sees every gradient before it is released.
        self.meter = LiveGradientMeter(self.model.parameters())
        if method in _ADAMA:
            from megatron_adacc.optim.megatron import setup_adama

            chunks, self.optimizer = setup_adama(args, [self.model], config)
            self.ddp = chunks[0]
            self.persistent_grad_bytes = 0
        else:
            self.ddp = model_lib.wrap_ddp(args, config, self.model)
            self.optimizer = model_lib.build_optimizer(args, self.ddp)
            # Megatron-LM's scheduler applies wd_mult (no decay on biases and norms); AdamA's groups do too.
            for group in self.optimizer.param_groups:
                group["weight_decay"] = args.weight_decay * group.get("wd_mult", 1.0)
            self.persistent_grad_bytes = gradient_buffer_bytes(self.ddp)

    def step(self, batches) -> float:
        import contextlib

        if hasattr(self.ddp, "zero_grad_buffer"):
            self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        total = 0.0
        for i, batch in enumerate(batches):
            sync = self.ddp.no_sync() if i < self.n - 1 and hasattr(self.ddp, "no_sync") else \
                contextlib.nullcontext()
            with sync:
                per_token = self.ddp(batch.tokens, batch.position_ids, batch.attention_mask,
                                     labels=batch.labels)
                loss = per_token.float().mean()
                (loss / self.n).backward()
            total += loss.item() / self.n
        if hasattr(self.ddp, "finish_grad_sync"):
            self.ddp.finish_grad_sync()
        ok, _, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("optimizer step skipped (non-finite gradients)")
        return total

    @property
    def gradient_held_bytes(self) -> int:
        """The persistent gradient buffer, the most ``.grad`` bytes alive at once, and (AdamA with the distributed
        optimizer) the most bytes of its reduction buckets alive at once: an upper bound of the gradient bytes held
        at any moment."""
        buckets = getattr(getattr(self.optimizer, "optimizer", None), "peak_transient_bytes", 0)
        return self.persistent_grad_bytes + self.meter.peak_bytes + buckets

    def memory_report(self, losses: list[float]) -> dict:
        return {"peak_memory_bytes": peak_resident_bytes(), "gradient_held_bytes": self.gradient_held_bytes,
                "gradient_buffer_bytes": self.persistent_grad_bytes,
                "optimizer_state_bytes": optimizer_state_bytes(self.optimizer), "param_bytes": self.param_bytes,
                "losses": losses}


def _time_run(args, config, n: int, data: list, methods: tuple[str, ...] = METHODS, world: int = 1) -> dict:
    """The methods from the same weights on the same batches, alternating step by step."""
    args.global_batch_size = args.micro_batch_size * n * world
    trainers = {m: _Trainer(m, args, config, n) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    losses: dict[str, list[float]] = {m: [] for m in methods}
    for i, batches in enumerate(data):
        # Alternate which method goes first so neither systematically inherits a warm cache.
        for m in methods if i % 2 == 0 else methods[::-1]:
            t0 = time.perf_counter()
            losses[m].append(trainers[m].step(batches))
            times[m].append(time.perf_counter() - t0)
    out = {m: {"step_time_s": statistics.median(times[m][1:] or times[m]), "losses": losses[m],
               "step_times_s": times[m]} for m in methods}
    out["tokens_per_step"] = n * args.micro_batch_size * args.seq_length * world
    return out


def _distributed_child(payload: dict, args, config) -> dict | None:
    """One rank of a distributed job: its memory under one method, or both methods' step times (rank 0 answers)."""
    import torch.distributed as dist

    from megatron_adacc.training.data import BatchSampler

    rank, world, n = dist.get_rank(), dist.get_world_size(), payload["n"]
    args.global_batch_size = args.micro_batch_size * n * world
    sampler = BatchSampler(args.seq_length, args.micro_batch_size, args.seed, rank=rank)
    data = [[next(sampler) for _ in range(n)] for _ in range(payload["steps"])]
    if "method" not in payload:
        result = _time_run(args, config, n, data, DISTRIBUTED_METHODS, world)
        return result if rank == 0 else None
    rss_before = resident_bytes()
    trainer = _Trainer(payload["method"], args, config, n)
    mine = trainer.memory_report([trainer.step(batches) for batches in data])
    mine["rss_before_training_bytes"] = rss_before
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    return {"ranks": ranks} if rank == 0 else None


def _child(payload_path: str) -> None:
    import torch

    from megatron_adacc.compat import quiet_fallback_warnings
    from megatron_adacc.training import distributed
    from megatron_adacc.training import model as model_lib
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.data import sampler_for

    quiet_fallback_warnings()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    payload = json.load(open(payload_path))
    args = parse_train_args(payload["flags"])
    distributed.initialize(torch.device("cpu"), args.seed)
    config = model_lib.transformer_config(args, torch.device("cpu"))

    def batches_for(n: int, steps: int) -> list:
        sampler = sampler_for(args)
        return [[next(sampler) for _ in range(n)] for _ in range(steps)]

    if payload["mode"] == "distributed":
        result = _distributed_child(payload, args, config)
    elif payload["mode"] == "memory":
        n = payload["n"]
        args.global_batch_size = args.micro_batch_size * n
        data = batches_for(n, payload["steps"])
        rss_before = resident_bytes()
        trainer = _Trainer(payload["method"], args, config, n)
        result = trainer.memory_report([trainer.step(batches) for batches in data])
        result["rss_before_training_bytes"] = rss_before
    else:
        result = {"runs": [_time_run(args, config, n, batches_for(n, steps)) for n, steps in payload["runs"]]}
    distributed.shutdown()
    if result is not None:  # rank 0 of a distributed job, or the only process
        sys.stdout.flush()
        print()
        print(json.dumps(result))


if __name__ == "__main__":
    _child(sys.argv[1])
