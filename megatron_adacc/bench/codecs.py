"""`adacc bench codecs`: throughput, compression ratio and error of every activation codec beside a copy.

For each tensor size (1 MB to 64 MB of uncompressed input) and each codec, in one process:

* ``compress_gbps`` / ``decompress_gbps``: uncompressed bytes / median wall time of ``compress`` /
  ``decompress`` (the codec API as the runtime calls it, allocation of the outputs included);
* ``copy_gbps``: the same bytes / median time of ``x.clone()`` of the same tensor, measured in the same
  rounds (clone also allocates its output, so page-fault costs are on both sides);
* ``roundtrip_vs_copy``: ``t_copy / (t_compress + t_decompress)``, the issue's target being >= 0.5 on CPU
  and >= 0.7 on GPU for tensors of 16 MB and more, for float32, float16 and bfloat16 inputs alike;
* the same four with a ``_best`` suffix from the fastest round instead of the median (on a shared machine
  the fastest round is the better estimate of unloaded speed; both are recorded);
* ``compression_ratio``: uncompressed bytes / ``Packed.nbytes``;
* ``max_rel_error``: ``max|x - x_hat| / max|x|``; ``rms_rel_error``: ``rms(x - x_hat) / rms(x)``.

Inputs are activation-like: ``[rows, 1024]`` Gaussian values with two channels 30x larger (the outliers of
Adacc Fig. 3a), in each ``--dtype`` (all three by default); the asymmetric codec gets softmax rows (its
intended input); the bit mask, which takes no float dtype, gets a bool dropout mask with as many elements as
the float tensor has bytes. Rounds alternate copy and every codec and dtype so that the load of a shared
machine falls on all of them alike; times are medians over rounds. On a machine shared with other jobs,
``--clock cpu --threads 1`` measures CPU time instead of elapsed time, which the waiting for a core does not
inflate (memory-bandwidth contention still does). The run ends with the acceptance figure, the round trip
against a copy per codec and dtype at 16 MB and up, which the results JSON keeps as ``roundtrip_vs_copy``:
``{device: {size: {codec: {dtype: ratio}}}}``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from megatron_adacc.bench import harness
from megatron_adacc.core.log import Steps, echo
from megatron_adacc.core.tables import format_table

CODECS: dict[str, tuple[str, dict]] = {
    "int4_symmetric": ("int4_symmetric", {}),
    "int4_asymmetric": ("int4_asymmetric", {}),
    "int4_channelwise": ("int4_channelwise", {}),
    "int4_smoothed": ("int4_smoothed", {}),
    "int4_outlier": ("int4_outlier", {}),
    "stochastic_4bit": ("stochastic", {"bits": 4}),
    "stochastic_2bit": ("stochastic", {"bits": 2}),
    "bitmask": ("bitmask", {}),
}
SIZES_MB = (1, 4, 16, 64)
QUICK_SIZES_MB = (1, 16)
CHANNELS = 1024
DTYPES = ("float32", "float16", "bfloat16")
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
DTYPE_FREE = frozenset({"bitmask"})
"""Codecs that take no float dtype: measured once, whatever ``--dtype`` lists."""
TARGET = {"cpu": 0.5, "cuda": 0.7}


def add_arguments(parser) -> None:
    parser.add_argument("--sizes-mb", type=int, nargs="*", default=None,
                        help=f"Uncompressed tensor sizes in MiB (default {list(SIZES_MB)}; --quick "
                             f"{list(QUICK_SIZES_MB)}).")
    parser.add_argument("--codecs", nargs="*", default=None, choices=list(CODECS), help="Subset of codecs.")
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                        help="Input dtypes of the float codecs, measured in the same alternating rounds "
                             "(default: all three).")
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


def _cases(names: list[str], dtypes: list[str]) -> list[tuple[str, str | None]]:
    """(codec, dtype) pairs to measure: every float codec in every dtype, a dtype-free codec once."""
    return [(n, d) for n in names for d in ([None] if n in DTYPE_FREE else dtypes)]


def _key(name: str, dtype: str | None, size_mb: int) -> str:
    return f"{name}@{size_mb}MB" + (f"[{SHORT[dtype]}]" if dtype else "")


def _bench_size(size_mb: int, cases: list[tuple[str, str | None]], device: str, rounds: int, clock: str) -> dict:
    from megatron_adacc.codecs import get_codec

    timed = _timer(device, clock)
    nbytes = size_mb << 20
    gen = torch.Generator().manual_seed(size_mb)
    inputs = {c: _inputs(c[0], nbytes, getattr(torch, c[1] or "float32"), device, gen) for c in cases}
    codecs = {c: get_codec(CODECS[c[0]][0], **CODECS[c[0]][1]) for c in cases}
    times: dict = {c: {"copy": [], "compress": [], "decompress": []} for c in cases}
    packed = {c: codecs[c].compress(inputs[c]) for c in cases}  # warm-up (and the packed size)
    for _ in range(rounds):
        for c in cases:
            x, codec, p = inputs[c], codecs[c], packed[c]
            times[c]["copy"].append(timed(x.clone))
            times[c]["compress"].append(timed(lambda c=codec, t=x: c.compress(t)))
            times[c]["decompress"].append(timed(lambda c=codec, q=p: c.decompress(q)))
    results = {}
    for c in cases:
        x = inputs[c]
        size = x.numel() * x.element_size()
        med = {k: statistics.median(v) for k, v in times[c].items()}
        best = {k: min(v) for k, v in times[c].items()}
        max_rel, rms_rel = _errors(x, codecs[c].decompress(packed[c]))
        results[_key(c[0], c[1], size_mb)] = {
            "codec": c[0],
            "compress_gbps": size / med["compress"] / 1e9,
            "decompress_gbps": size / med["decompress"] / 1e9,
            "copy_gbps": size / med["copy"] / 1e9,
            "roundtrip_vs_copy": med["copy"] / (med["compress"] + med["decompress"]),
            # Fastest round of each: on a shared machine the best estimate of the unloaded speed.
            "compress_gbps_best": size / best["compress"] / 1e9,
            "decompress_gbps_best": size / best["decompress"] / 1e9,
            "copy_gbps_best": size / best["copy"] / 1e9,
            "roundtrip_vs_copy_best": best["copy"] / (best["compress"] + best["decompress"]),
            "compression_ratio": size / packed[c].nbytes,
            "max_rel_error": max_rel,
            "rms_rel_error": rms_rel,
            "device": device,
            "size_mb": size_mb,
            "size_bytes": size,
            "dtype": str(x.dtype).replace("torch.", ""),
        }
    return results


def _ratios(methods: dict) -> dict:
    """``{device: {size: {codec: {dtype: ratio}}}}`` at 16 MB and up: the acceptance figure."""
    out: dict = {}
    for v in methods.values():
        if v["size_bytes"] >= 16 << 20:
            size = f"{v['size_mb']}MB"
            out.setdefault(v["device"], {}).setdefault(size, {}).setdefault(v["codec"], {})[v["dtype"]] = {
                "roundtrip_vs_copy": round(v["roundtrip_vs_copy"], 3),
                "roundtrip_vs_copy_best": round(v["roundtrip_vs_copy_best"], 3),
                "meets_target": v["roundtrip_vs_copy"] >= TARGET[v["device"]],
            }
    return out


def _print_summary(ratios: dict, config: dict) -> None:
    """The acceptance figure alone: per device and size, each codec's round trip against a copy per dtype."""
    dtypes = config["dtypes"]
    echo(f"\nround trip vs copy (median of {config['rounds']} alternating rounds; fastest rounds in brackets), "
         f"{config['threads']} threads, {config['clock']} clock, load average {config['loadavg_1min']:.2f} on "
         f"{config['cpus']} CPUs; target {TARGET['cpu']} CPU, {TARGET['cuda']} CUDA")
    if not ratios:
        echo("(no size of 16 MB or more was measured)")
    for device, sizes in ratios.items():
        for size, codecs in sizes.items():
            rows, below = [], []
            for codec, per_dtype in codecs.items():
                measured = per_dtype.items() if codec in DTYPE_FREE else [(d, per_dtype.get(d)) for d in dtypes]
                cells = []
                for dtype, r in measured:
                    cells.append("" if r is None else
                                 f"{r['roundtrip_vs_copy']:.2f} ({r['roundtrip_vs_copy_best']:.2f})")
                    if r is not None and not r["meets_target"]:
                        below.append(codec if codec in DTYPE_FREE else f"{codec} {SHORT[dtype]}")
                if codec in DTYPE_FREE and len(dtypes) > 1:
                    cells += ["(takes no float dtype)"] + [""] * (len(dtypes) - 2)
                rows.append([codec, *cells])
            echo(f"{device}, {size}:")
            echo(format_table(["codec", *[SHORT[d] for d in dtypes]], rows))
            echo("below target: " + (", ".join(below) or "none"))


def run(args) -> dict:
    from megatron_adacc import codecs as codec_pkg

    if args.threads:
        torch.set_num_threads(args.threads)
    quick = bool(getattr(args, "quick", False))
    sizes = args.sizes_mb or (QUICK_SIZES_MB if quick else SIZES_MB)
    rounds = args.rounds or (3 if quick else 7)
    names = args.codecs or list(CODECS)
    dtypes = list(dict.fromkeys(args.dtype))
    cases = _cases(names, dtypes)
    devices = ["cpu"] if args.device == "cpu" else ["cuda"] if args.device == "cuda" else (
        ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    methods: dict[str, dict] = {}
    with Steps(len(devices) * len(sizes), "codecs") as step:
        for device in devices:
            for size_mb in sizes:
                step(f"{size_mb} MiB on {device}")
                for key, values in _bench_size(size_mb, cases, device, rounds, args.clock).items():
                    methods[key if device == "cpu" else f"{key}[cuda]"] = values
    isa = None
    try:
        from megatron_adacc.codecs import _backend

        isa = _backend._C.cpu_isa() if _backend._C is not None else None
    except AttributeError:
        pass
    config = {
        "sizes_mb": list(sizes), "dtypes": dtypes, "rounds": rounds, "codecs": names, "devices": devices,
        "threads": torch.get_num_threads(), "backend": codec_pkg.backend("cpu"), "cpu_isa": isa,
        "channels": CHANNELS, "quick": quick, "clock": args.clock,
        # A loaded machine slows the codecs and the copy unequally: the ratios are read with this beside them.
        "loadavg_1min": os.getloadavg()[0], "cpus": os.cpu_count(),
    }
    ratios = _ratios(methods)
    harness.print_table(
        methods,
        metrics=["compress_gbps", "decompress_gbps", "copy_gbps", "roundtrip_vs_copy", "roundtrip_vs_copy_best",
                 "compression_ratio", "max_rel_error", "rms_rel_error"],
        title=f"codecs ({', '.join(dtypes)}, {torch.get_num_threads()} threads, {args.clock} clock, "
              f"backend {config['backend']}, isa {isa})",
    )
    _print_summary(ratios, config)
    harness.write_results("codecs", config, methods, extra={"target_roundtrip_vs_copy": TARGET,
                                                            "roundtrip_vs_copy": ratios}, args=args)
    return {"config": config, "methods": methods, "roundtrip_vs_copy": ratios}
