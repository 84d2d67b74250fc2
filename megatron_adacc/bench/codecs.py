"""`adacc bench codecs`: throughput, compression ratio and error of every activation codec beside a copy.

For each tensor size (1 MB to 64 MB of uncompressed input) and each codec, in one process:

* ``compress_gbps`` / ``decompress_gbps``: uncompressed bytes / median wall time of ``compress`` /
  ``decompress`` (the codec API as the runtime calls it, allocation of the outputs included);
* ``copy_gbps``: the same bytes / median time of ``x.clone()`` of the same tensor, measured in the same
  rounds (clone also allocates its output, so page-fault costs are on both sides);
* ``roundtrip_vs_copy``: ``t_copy / (t_compress + t_decompress)``, the issue's target being >= 0.5 on CPU
  and >= 0.7 on GPU for tensors of 16 MB and more;
* the same four with a ``_best`` suffix from the fastest round instead of the median (on a shared machine
  the fastest round is the better estimate of unloaded speed; both are recorded);
* ``compression_ratio``: uncompressed bytes / ``Packed.nbytes``;
* ``max_rel_error``: ``max|x - x_hat| / max|x|``; ``rms_rel_error``: ``rms(x - x_hat) / rms(x)``.

Inputs are activation-like: ``[rows, 1024]`` Gaussian values with two channels 30x larger (the outliers of
Adacc Fig. 3a); the asymmetric codec gets softmax rows (its intended input); the bit mask gets a bool
dropout mask with as many elements as the float tensor has bytes. Rounds alternate copy and every codec so
that the load of a shared machine falls on all of them alike; times are medians over rounds. On a machine
shared with other jobs, ``--clock cpu --threads 1`` measures CPU time instead of elapsed time, which the
waiting for a core does not inflate (memory-bandwidth contention still does).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from megatron_adacc.bench import harness
from megatron_adacc.core.log import Steps

CODECS: dict[str, tuple[str, dict]] = {
    "int4_symmetric": ("int4_symmetric", {}),
    "int4_asymmetric": ("int4_asymmetric", {}),
    "int4_channelwise": ("int4_channelwise", {}),
    "int4_outlier": ("int4_outlier", {}),
    "stochastic_4bit": ("stochastic", {"bits": 4}),
    "stochastic_2bit": ("stochastic", {"bits": 2}),
    "bitmask": ("bitmask", {}),
}
SIZES_MB = (1, 4, 16, 64)
QUICK_SIZES_MB = (1, 16)
CHANNELS = 1024


def add_arguments(parser) -> None:
    parser.add_argument("--sizes-mb", type=int, nargs="*", default=None,
                        help=f"Uncompressed tensor sizes in MiB (default {list(SIZES_MB)}; --quick "
                             f"{list(QUICK_SIZES_MB)}).")
    parser.add_argument("--codecs", nargs="*", default=None, choices=list(CODECS), help="Subset of codecs.")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="Input dtype of the float codecs.")
    parser.add_argument("--rounds", type=int, default=None, help="Timed rounds per size (default 7; --quick 3).")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CPU, and CUDA too when a GPU is visible.")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's).")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="wall: elapsed time; cpu: CPU time of this process (user + system, all its "
                             "threads), which excludes time spent waiting for a core on a loaded machine; "
                             "with --threads 1 it is the single-core throughput. CUDA always uses wall.")


def _inputs(name: str, nbytes: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    if name == "bitmask":
        return (torch.rand(nbytes, generator=gen) < 0.9).to(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = max(1, nbytes // itemsize // CHANNELS)
    if name == "int4_asymmetric":
        return torch.softmax(torch.randn(rows, CHANNELS, generator=gen), dim=-1).to(device, dtype)
    x = torch.randn(rows, CHANNELS, generator=gen)
    x[:, :2] *= 30
    return x.to(device, dtype)


def _timer(device: str, clock: str) -> Callable[[Callable[[], object]], float]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    now = time.process_time if (clock == "cpu" and device == "cpu") else time.perf_counter

    def timed(fn: Callable[[], object]) -> float:
        sync()
        t0 = now()
        fn()
        sync()
        return now() - t0

    return timed


def _errors(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    if x.dtype == torch.bool:
        return float((x != y).sum()), float((x != y).sum())
    xf, yf = x.double(), y.double()
    diff = xf - yf
    max_rel = float(diff.abs().max() / xf.abs().max().clamp_min(1e-300))
    rms_rel = float(diff.square().mean().sqrt() / xf.square().mean().sqrt().clamp_min(1e-300))
    return max_rel, rms_rel


def _bench_size(size_mb: int, names: list[str], dtype: torch.dtype, device: str, rounds: int,
                clock: str) -> dict:
    from megatron_adacc.codecs import get_codec

    timed = _timer(device, clock)
    nbytes = size_mb << 20
    gen = torch.Generator().manual_seed(size_mb)
    inputs = {n: _inputs(n, nbytes, dtype, device, gen) for n in names}
    codecs = {n: get_codec(CODECS[n][0], **CODECS[n][1]) for n in names}
    times: dict[str, dict[str, list[float]]] = {n: {"copy": [], "compress": [], "decompress": []} for n in names}
    packed = {n: codecs[n].compress(inputs[n]) for n in names}  # warm-up (and the packed size)
    for _ in range(rounds):
        for n in names:
            x, codec, p = inputs[n], codecs[n], packed[n]
            times[n]["copy"].append(timed(x.clone))
            times[n]["compress"].append(timed(lambda c=codec, t=x: c.compress(t)))
            times[n]["decompress"].append(timed(lambda c=codec, q=p: c.decompress(q)))
    results = {}
    for n in names:
        x = inputs[n]
        size = x.numel() * x.element_size()
        med = {k: statistics.median(v) for k, v in times[n].items()}
        best = {k: min(v) for k, v in times[n].items()}
        max_rel, rms_rel = _errors(x, codecs[n].decompress(packed[n]))
        results[f"{n}@{size_mb}MB"] = {
            "compress_gbps": size / med["compress"] / 1e9,
            "decompress_gbps": size / med["decompress"] / 1e9,
            "copy_gbps": size / med["copy"] / 1e9,
            "roundtrip_vs_copy": med["copy"] / (med["compress"] + med["decompress"]),
            # Fastest round of each: on a shared machine the best estimate of the unloaded speed.
            "compress_gbps_best": size / best["compress"] / 1e9,
            "decompress_gbps_best": size / best["decompress"] / 1e9,
            "copy_gbps_best": size / best["copy"] / 1e9,
            "roundtrip_vs_copy_best": best["copy"] / (best["compress"] + best["decompress"]),
            "compression_ratio": size / packed[n].nbytes,
            "max_rel_error": max_rel,
            "rms_rel_error": rms_rel,
            "device": device,
            "size_bytes": size,
            "dtype": str(x.dtype).replace("torch.", ""),
        }
    return results


def _print_summary(summary: dict, config: dict, target: dict) -> None:
    """The acceptance figure alone: each codec's round trip against a copy at 16 MB and up, one per line."""
    print(f"\nround trip vs copy, {config['dtype']}, {config['threads']} threads, {config['clock']} clock, load "
          f"average {config['loadavg_1min']:.2f} on {config['cpus']} CPUs (target: {target['cpu']} CPU, "
          f"{target['cuda']} CUDA)")
    for key, v in summary.items():
        verdict = "ok" if v["meets_target"] else "BELOW TARGET"
        print(f"  {key:<28} {v['roundtrip_vs_copy']:5.2f}  (fastest rounds {v['roundtrip_vs_copy_best']:5.2f})  "
              f"{verdict}")


def run(args) -> dict:
    from megatron_adacc import codecs as codec_pkg

    if args.threads:
        torch.set_num_threads(args.threads)
    quick = bool(getattr(args, "quick", False))
    sizes = args.sizes_mb or (QUICK_SIZES_MB if quick else SIZES_MB)
    rounds = args.rounds or (3 if quick else 7)
    names = args.codecs or list(CODECS)
    dtype = getattr(torch, args.dtype)
    devices = ["cpu"] if args.device == "cpu" else ["cuda"] if args.device == "cuda" else (
        ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    methods: dict[str, dict] = {}
    with Steps(len(devices) * len(sizes), "codecs") as step:
        for device in devices:
            for size_mb in sizes:
                step(f"{size_mb} MiB on {device}")
                for key, values in _bench_size(size_mb, names, dtype, device, rounds, args.clock).items():
                    methods[key if device == "cpu" else f"{key}[cuda]"] = values
    isa = None
    try:
        from megatron_adacc.codecs import _backend

        isa = _backend._C.cpu_isa() if _backend._C is not None else None
    except AttributeError:
        pass
    config = {
        "sizes_mb": list(sizes), "dtype": args.dtype, "rounds": rounds, "codecs": names, "devices": devices,
        "threads": torch.get_num_threads(), "backend": codec_pkg.backend("cpu"), "cpu_isa": isa,
        "channels": CHANNELS, "quick": quick, "clock": args.clock,
        # A loaded machine slows the codecs and the copy unequally: the ratios are read with this beside them.
        "loadavg_1min": os.getloadavg()[0], "cpus": os.cpu_count(),
    }
    target = {"cpu": 0.5, "cuda": 0.7}
    summary = {
        key: {"roundtrip_vs_copy": round(v["roundtrip_vs_copy"], 3),
              "roundtrip_vs_copy_best": round(v["roundtrip_vs_copy_best"], 3),
              "meets_target": v["roundtrip_vs_copy"] >= target[v["device"]]}
        for key, v in methods.items() if v["size_bytes"] >= 16 << 20
    }
    harness.print_table(
        methods,
        metrics=["compress_gbps", "decompress_gbps", "copy_gbps", "roundtrip_vs_copy", "roundtrip_vs_copy_best",
                 "compression_ratio", "max_rel_error", "rms_rel_error"],
        title=f"codecs ({args.dtype}, {torch.get_num_threads()} threads, {args.clock} clock, "
              f"backend {config['backend']}, isa {isa})",
    )
    _print_summary(summary, config, target)
    harness.write_results("codecs", config, methods, extra={"target_roundtrip_vs_copy": target,
                                                            "summary_16mb_and_up": summary}, args=args)
    return {"config": config, "methods": methods, "summary": summary}
