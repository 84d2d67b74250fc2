"""``adacc profile``, ``adacc solve``, ``adacc show`` and ``adacc plan``: the policy maker on the command line.

``profile``, ``solve`` and ``plan`` take the same model flags and ``--config`` as ``adacc train``, so the signature
they profile and solve for is the one training will check; ``plan`` adds the parallel layout and the GPU.
"""

from __future__ import annotations

import argparse
import textwrap
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from megatron_adacc.core import log
from megatron_adacc.core.errors import ArgumentParser, UsageError, refusal_boundary
from megatron_adacc.core.gpus import GPUS
from megatron_adacc.core.tables import WIDTH, format_table
from megatron_adacc.core.units import checked, format_bytes, parse_positive_bytes, positive_int
from megatron_adacc.training.args import add_train_args, parse_train_args

# The policy code (and torch under it) is imported by the functions that use it, after the command line is
# parsed: a refused command line answers at once. The Megatron glue is imported later still (see cmd_profile).
if TYPE_CHECKING:
    from megatron_adacc.adacc.policy.policy import Policy
    from megatron_adacc.adacc.policy.profile import LayerProfile

LOG = log.get_logger()


def _fmt_bytes(n: float | None) -> str:
    return format_bytes(n, digits=2)


def _fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3f} ms"


# ------------------------------------------------------------------------------------------ parsers
class _Deprecated(argparse.Action):
    """A flag's old spelling: it still works, storing into the new flag's destination, and the command says once
    that it is deprecated (:func:`_say_deprecated`). Left out of the help."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        used = dict(getattr(namespace, "deprecated_flags", None) or {})
        used[option_string] = self.new
        namespace.deprecated_flags = used


def _say_deprecated(args: SimpleNamespace) -> None:
    for old, new in (getattr(args, "deprecated_flags", None) or {}).items():
        LOG.warning("%s is deprecated and will go: use %s", old, new)


class _Into:
    """A parser whose loose flags go into ``group``: `adacc train`'s (--config, --device ...) under the command's
    own, and its groups after them."""

    def __init__(self, parser: argparse.ArgumentParser, group) -> None:
        self.parser, self.group = parser, group

    def add_argument(self, *args: Any, **kwargs: Any):
        return self.group.add_argument(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


#: The flags of `adacc train` each command reads, which its help shows; it accepts the others too (a config file
#: may set any of them) but does not list them.
_SHOWN = {
    "profile": ("--config", "--device", "--micro-batch-size", "--adacc-profile-db", "--adacc-outlier-z",
                "--logging-level"),
    "solve": ("--config", "--device", "--micro-batch-size", "--adacc-memory-budget", "--adacc-memory-headroom",
              "--adacc-process-baseline", "--adacc-profile-db", "--adacc-codec", "--adacc-outlier-z",
              "--adacc-no-outlier-separation", "--adacc-mlp-tiles", "--adacc-chain-aware", "--adacc-heterogeneous",
              "--logging-level"),
    "plan": ("--config", "--micro-batch-size", "--global-batch-size", "--num-layers", "--hidden-size",
             "--num-attention-heads", "--num-query-groups", "--group-query-attention", "--ffn-hidden-size",
             "--seq-length", "--attention-backend", "--bf16", "--use-distributed-optimizer", "--adacc-memory-budget",
             "--adacc-memory-headroom", "--adacc-codec", "--adacc-no-outlier-separation", "--output-json",
             "--logging-level"),
}

_DESCRIPTIONS = {
    "profile": "Profile one transformer layer of the configured model: per-op bytes, recompute and codec times, "
               "stored in the profile database that `adacc solve` and `adacc train --adacc-policy auto` read.",
    "solve": "Solve Adacc's MILP for a memory budget (--adacc-memory-budget, as `adacc train` takes it) and write "
             "a policy file.",
    "plan": "Plan a model on GPUs without one: per-GPU memory of Megatron's recompute modes, INT4 everywhere and "
            "Adacc under a parallel layout, the largest micro-batch each fits, Adacc's policy, and step times "
            "predicted by a roofline. The layer is megatron-core's own, sized on fake tensors.",
}


def _parser(command: str) -> argparse.ArgumentParser:
    """``adacc profile`` / ``solve`` / ``plan``: the command's own flags, then the model, as `adacc train` reads it
    (every flag of `adacc train` is accepted, the ones this command reads are listed: :data:`_SHOWN`). An own flag
    replaces `adacc train`'s of the same name (``plan --device`` names a GPU)."""
    parser = ArgumentParser(prog=f"adacc {command}", description=_DESCRIPTIONS[command], conflict_handler="resolve")
    model = parser.add_argument_group("model", "the model and settings, as `adacc train` reads them: --config and "
                                      "any flag of `adacc train --help` (e.g. --num-layers); listed here and below are "
                                      "the ones this command reads")
    add_train_args(_Into(parser, model))
    before = list(parser._actions)  # kept alive: an id is unique only while its object lives
    _OWN_FLAGS[command](parser)
    own = {id(action) for action in parser._actions} - {id(action) for action in before}
    shown = set(_SHOWN[command])
    for action in parser._actions:
        if id(action) not in own and not shown & set(action.option_strings):
            action.help = argparse.SUPPRESS
    for group in parser._action_groups:
        if group is not model and all(a.help == argparse.SUPPRESS for a in group._group_actions):
            group.description = None  # an argparse group with nothing to list prints nothing
    return parser


def _add_profile_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--refresh", "--force", dest="force", action="store_true",
                   help="Profile again even if the database has this model (the newest profile is the one used): "
                        "after a profile measured under contention, or a change of machine load or software.")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="Timed repetitions per measurement (median; more while they disagree).")


def _add_solve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", "-o", default="adacc-policy.json", help="Where to write the policy file.")
    # Not --adacc-codecs: beside the training flag --adacc-codec (a codec family) that name read as its plural.
    # The destination stays adacc_codecs, which SolveOptions.from_args reads.
    p.add_argument("--candidate-codecs", dest="adacc_codecs", choices=("default", "all"), default="default",
                   help="Which profiled codecs the MILP may choose per op. default: each op's layer-specific "
                        "codec (the paper); all: every codec that applies to the op.")
    p.add_argument("--analytic", action="store_true",
                   help="Solve from shape formulas instead of a measured profile (no model run; a first guess).")
    # The old spellings: `adacc train`'s flag is the budget's one name; --adacc-codecs read as --adacc-codec's plural.
    p.add_argument("--budget", action=_Deprecated, dest="adacc_memory_budget", new="--adacc-memory-budget",
                   type=parse_positive_bytes, metavar="BYTES")
    p.add_argument("--adacc-codecs", action=_Deprecated, dest="adacc_codecs", new="--candidate-codecs",
                   choices=("default", "all"))


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", dest="gpu", choices=tuple(GPUS), default=None,
                   help="The GPU planned for: its memory, and its arithmetic and bandwidth for predicted times "
                        "(default a100-80gb).")
    p.add_argument("--device-memory", type=parse_positive_bytes, default=None, metavar="SIZE",
                   help="The GPU's memory, e.g. 32GiB (default: the --device's).")
    p.add_argument("--tensor-model-parallel-size", type=positive_int, default=1, metavar="N", help="TP size.")
    p.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1, metavar="N",
                   help="PP size (1F1B, no interleaving).")
    p.add_argument("--data-parallel-size", type=positive_int, default=1, metavar="N",
                   help="DP size: the GPUs are TP x PP x DP (the distributed optimizer shards over DP).")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron's sequence parallelism (needs TP).")
    p.add_argument("--vocab-size", type=positive_int, default=50257, metavar="N",
                   help="The tokenizer's vocabulary, padded as Megatron-LM pads it (default 50257, GPT-2's BPE, "
                        "pretrain_gpt.py's default tokenizer).")
    p.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128, metavar="N",
                   help="Megatron-LM's padding of the vocabulary (times the TP size).")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="An output layer of its own instead of the word embeddings.")
    p.add_argument("--fp16", action="store_true", help="fp16 parameters (a V100 has no bf16 arithmetic).")
    p.add_argument("--no-masked-softmax-fusion", action="store_true",
                   help="As Megatron-LM's flag: the unfused softmax, which keeps fp32 attention probabilities.")
    p.add_argument("--outlier-fraction", type=checked(float, lambda f: 0 <= f <= 1, "a share in [0, 1]"),
                   default=0.01, metavar="SHARE",
                   help="Share of channels the outlier-separated codec keeps exact (data-dependent; default 0.01).")
    p.add_argument("--no-search", action="store_true", help="Skip the search for each method's largest micro-batch.")
    p.add_argument("--sweep", type=positive_int, nargs="+", default=(), metavar="B",
                   help="Also predict each method's step time at these micro-batches.")


_OWN_FLAGS = {"profile": _add_profile_flags, "solve": _add_solve_flags, "plan": _add_plan_flags}


def _add_show_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("policy", help="A policy file written by `adacc solve`.")
    p.add_argument("--all-layers", action="store_true", help="One table per layer instead of per group.")
    p.add_argument("--all-ops", action="store_true",
                   help="List the ops that save nothing for backward too (hidden by default: no decision changes "
                        "their memory).")


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> SimpleNamespace:
    args = parse_train_args(argv, parser, feature_flags_need_feature=False)
    if args.logging_level is not None:  # Megatron-LM's flag; -q / -v given to `adacc` win over it
        log.install(args.logging_level)
    _say_deprecated(args)
    return args


def main(argv: list[str]) -> int:
    """``adacc profile|solve|show ...`` (``argv[0]`` is the command) behind the ``adacc`` command's error
    boundary: a refusal is one line on stderr and exit status 2."""
    return refusal_boundary(run, argv)


def run(argv: list[str]) -> int:
    """:func:`main` without the boundary: refusals propagate as exceptions (``adacc`` calls this)."""
    command, rest = argv[0], argv[1:]
    if command == "show":
        p = ArgumentParser(prog="adacc show", description="Print a policy file as a per-op table, with per-layer "
                           "totals, beside the presets' predictions where its profile is at hand.")
        _add_show_flags(p)
        return cmd_show(p.parse_args(rest))
    if command == "profile":
        return cmd_profile(_parse(_parser("profile"), rest))
    if command == "solve":
        return cmd_solve(_parse(_parser("solve"), rest))
    if command == "plan":
        return cmd_plan(_parse(_parser("plan"), rest))
    raise UsageError(f"unknown policy command {command!r}; the policy commands are profile, solve, show and plan")


# ------------------------------------------------------------------------------------------ commands
def _config(args: SimpleNamespace):
    import torch

    from megatron_adacc.training import distributed
    from megatron_adacc.training import model as model_lib

    device = distributed.resolve_device(getattr(args, "device", "auto"))
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    return device, model_lib.transformer_config(args, device)


def cmd_profile(args: SimpleNamespace) -> int:
    """Profile (or, unless ``--refresh``, reuse) this model's layer; print its per-op table."""
    # The Megatron glue (integration, the runtime, megatron-core) is imported by the commands that use it, so
    # that `adacc show` and `--help` do not load it.
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    ProfileDB(getattr(args, "adacc_profile_db", None))  # a database that cannot be used stops us before Megatron
    from megatron_adacc.adacc.integration.auto import get_or_make_profile
    from megatron_adacc.training import distributed

    device, config = _config(args)
    distributed.initialize(device, getattr(args, "seed", 1234))
    profile, ref = get_or_make_profile(args, config, force=args.force)
    log.echo(render_profile(profile))
    LOG.info("profile #%s in %s", ref["id"], ref["db"])
    return 0


def cmd_solve(args: SimpleNamespace) -> int:
    """Solve for ``--adacc-memory-budget`` (default: the device's memory), write the policy file, print it."""
    from megatron_adacc.adacc.policy.io import save_policy
    from megatron_adacc.adacc.policy.profile import analytic_profile
    from megatron_adacc.adacc.policy.profile_db import ProfileDB
    from megatron_adacc.adacc.policy.signature import model_signature
    from megatron_adacc.adacc.policy.solver import SolveOptions, solve_policy

    if not args.analytic:
        ProfileDB(getattr(args, "adacc_profile_db", None))  # as in cmd_profile
    from megatron_adacc.adacc.integration.profiler import device_memory_bytes  # lazy: see cmd_profile

    device, config = _config(args)
    budget = getattr(args, "adacc_memory_budget", None) or device_memory_bytes(device)
    options = SolveOptions.from_args(args)
    if args.analytic:
        profile, ref = analytic_profile(model_signature(config, args)), None
    else:
        from megatron_adacc.adacc.integration.auto import codec_pages, get_or_make_profile, process_baseline
        from megatron_adacc.core.devices import resident_bytes
        from megatron_adacc.training import distributed

        distributed.initialize(device, getattr(args, "seed", 1234))
        resident = resident_bytes()  # before profiling, as auto takes it
        profile, ref = get_or_make_profile(args, config)
        if device.type == "cpu" and not options.process_baseline_bytes:
            # On the CPU the budget is the training process's peak RSS, which also holds the interpreter and the
            # libraries: the figure auto calibrated for this profile, else this process's own resident size.
            options.process_baseline_bytes = process_baseline(args, profile, ref, resident, LOG.info)
            options.codec_pages_bytes = codec_pages(args, ref)
    policy, result = solve_policy(profile, budget, options, profile_ref=ref, signature=model_signature(config, args))
    path = save_policy(policy, args.output)
    log.echo(render_policy(policy, profile, budget=budget))
    LOG.info("wrote %s (%s, %s, solved in %.0f ms)", path, result.strategy, result.status, result.solve_time_s * 1e3)
    return 0


def cmd_plan(args: SimpleNamespace) -> int:
    """Plan the model on ``--device`` under the layout: print the plan (and write ``--output-json``)."""
    import json

    import torch

    from megatron_adacc.adacc.planner.layout import Layout, padded_vocab_size

    if args.fp16 and args.bf16:
        raise UsageError("--fp16 and --bf16 name two precisions; give one")
    gpu = GPUS[args.gpu or "a100-80gb"]
    gpu.flops("float16" if args.fp16 else "bfloat16" if args.bf16 else "float32")  # refuses bf16 on a V100
    layout = Layout.from_args(args)
    args.device = "cpu"  # where the fake model is sized; --device named the GPU
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, layout.tensor)
    _, config = _config(args)
    if args.fp16:
        config.fp16, config.params_dtype = True, torch.float16
    layout.check(config, args.seq_length)  # before megatron starts: a layout that cannot be is one line
    from megatron_adacc.adacc.planner.plan import Planner, make_plan, nothing_fits
    from megatron_adacc.adacc.planner.report import render, to_json
    from megatron_adacc.adacc.policy.solver import SolveOptions
    from megatron_adacc.codecs.base import assuming
    from megatron_adacc.training import distributed

    distributed.initialize(torch.device("cpu"), getattr(args, "seed", 1234))
    with assuming(outlier_fraction=args.outlier_fraction), \
            Planner(args, config, layout, gpu, args.device_memory, budget_bytes=args.adacc_memory_budget,
                    options=SolveOptions.from_args(args), masked_softmax_fusion=not args.no_masked_softmax_fusion
                    ) as planner:
        plan = make_plan(planner, args.micro_batch_size, search=not args.no_search, sweep=tuple(args.sweep))
        nothing_fits(planner, plan)
        log.echo(render(planner, plan))
        if args.output_json:
            from megatron_adacc.core.files import atomic_write

            text = json.dumps(to_json(planner, plan), indent=2, default=str) + "\n"
            atomic_write(args.output_json, lambda f: f.write(text.encode()))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """Print a policy file: its decisions and sizes per layer group, and the predictions beside the presets'."""
    from megatron_adacc.adacc.policy.io import load_policy
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    policy = load_policy(args.policy)
    profile = ProfileDB.referenced(policy.profile)  # a policy file names what to read, never where to write
    log.echo(render_policy(policy, profile, all_layers=getattr(args, "all_layers", False),
                           all_ops=getattr(args, "all_ops", False)))
    return 0


# ------------------------------------------------------------------------------------------ rendering
def render_profile(profile: LayerProfile) -> str:
    """A profile's per-op table: bytes, recompute time, the smallest codec's ratio and time."""
    rows = []
    for op in profile.ops:
        best = min(op.codecs.items(), key=lambda kv: kv[1].compressed_bytes, default=None)
        rows.append([op.name, best[0] if best else "-", _fmt_bytes(op.saved_bytes), _fmt_ms(op.forward_time_s),
                     f"{best[1].compressed_bytes / op.saved_bytes:.3f}" if best and op.saved_bytes else "-",
                     _fmt_ms(best[1].compress_time_s + best[1].decompress_time_s) if best else "-"])
    signature = ", ".join(f"{k}={v}" for k, v in profile.signature.items())
    head = "\n".join(textwrap.wrap(
        f"profile of {profile.device} ({profile.source}); {signature}. Static {_fmt_bytes(profile.static_bytes)}, "
        f"workspace {_fmt_bytes(profile.workspace_bytes)}. "
        f"Times below are micro-benchmarks; in the runtime the cost model scales codec times by "
        f"{profile.codec_time_scale:.2f} and recompute times by {profile.recompute_time_scale:.2f}, and charges "
        f"{_fmt_ms(profile.runtime_overhead_s)} per layer that does not keep everything (the runtime's own cost) "
        f"and {_fmt_ms(profile.tile_overhead_s)} per tile beyond the first of an MLP re-run in tiles.",
        WIDTH))
    return head + "\n\n" + format_table(["op", "smallest codec", "saved", "recompute", "crate", "c+dc time"], rows,
                                        right=range(2, 6))


def _groups(policy: Policy, all_layers: bool) -> list[tuple[str, int, int]]:
    """(label, first layer, layer count) per run of identical consecutive layers."""
    out, start = [], 0
    for i in range(1, policy.num_layers + 1):
        if i == policy.num_layers or all_layers or policy.layers[i] != policy.layers[start]:
            out.append((f"layer {start}" if i - 1 == start else f"layers {start}-{i - 1}", start, i - start))
            start = i
    return out


def _layer_table(policy: Policy, first: int, count: int, all_ops: bool) -> tuple[str, list[str], tuple | None]:
    """One group's table, the ops it hides (they save nothing for backward), and one layer's totals
    ``(saved, stored, time)`` (None where a size is unknown)."""
    from megatron_adacc.adacc.policy.ops import OP_NAMES

    rows, hidden, totals = [], [], [0, 0, 0.0]
    for op, d in zip(OP_NAMES, policy.layers[first]):
        cost = policy.decision_cost(op, d)
        if cost is None:
            totals = None
        elif totals is not None:
            totals = [t + c for t, c in zip(totals, cost)]
        if cost is not None and cost[0] == 0 and not all_ops:
            hidden.append(op)
            continue
        params = ",".join(f"{k}={v}" for k, v in sorted(d.codec_params.items()))
        saved, stored, time_s = cost if cost is not None else (None, None, None)
        rows.append([op, d.label + (f" ({params})" if params else ""), _fmt_bytes(saved), _fmt_bytes(stored),
                     _fmt_ms(time_s)])
    if totals is not None:
        rows.append(["per layer", "", *_totals(totals, 1)])
        if count > 1:
            rows.append([f"x {count} layers", "", *_totals(totals, count)])
    table = format_table(["op", "decision", "saved if kept", "stored", "time cost"], rows, right=range(2, 5))
    return table, hidden, tuple(totals) if totals is not None else None


def _prose(text: str) -> str:
    """A sentence of a report, in lines of at most :data:`~megatron_adacc.core.tables.WIDTH` (a leading blank
    line kept)."""
    return ("\n" if text.startswith("\n") else "") + textwrap.fill(text.strip("\n"), WIDTH)


def _totals(totals: list | tuple, count: int) -> list[str]:
    saved, stored, time_s = totals
    return [_fmt_bytes(saved * count), _fmt_bytes(stored * count), _fmt_ms(time_s * count)]


def render_policy(policy: Policy, profile: LayerProfile | None = None, *, all_layers: bool = False,
                  all_ops: bool = False, budget: int | None = None) -> str:
    """A policy's decisions per group of identical layers with their sizes and per-layer totals, then its
    predicted memory and time beside the presets' (these need ``profile``). Sizes come from the file
    (:attr:`Policy.op_costs`), else from ``profile``; ops that save nothing are hidden unless ``all_ops``.
    ``budget``: the budget as the user gave it, whose units the budget is printed in."""
    if policy.op_costs is None and profile is not None:  # a file written before it kept its sizes
        from megatron_adacc.adacc.policy.solver import op_costs

        policy = policy.copy()
        policy.op_costs = op_costs(profile, policy)
    parts = [_prose(f"policy {policy.name or '-'}: {policy.num_layers} layers, budget "
                    f"{format_bytes(policy.budget_bytes, 2, like=budget)}, solver "
                    f"{policy.solver.get('strategy', '-')} ({policy.solver.get('status', '-')})")]
    hidden: set[str] = set()
    whole: list | None = [0, 0, 0.0]
    for label, first, count in _groups(policy, all_layers):
        table, hides, totals = _layer_table(policy, first, count, all_ops)
        parts.append(f"\n{label}" + (" (each)" if count > 1 else "") + f"\n{table}")
        hidden.update(hides)
        whole = None if whole is None or totals is None else [w + t * count for w, t in zip(whole, totals)]
    if hidden:
        parts.append(_prose(f"\nnot listed, as they save nothing for backward (--all-ops lists them): "
                            f"{', '.join(sorted(hidden))}"))
    if whole is not None and len(_groups(policy, all_layers)) > 1:
        saved, stored, time_s = whole
        parts.append(_prose(f"\nall {policy.num_layers} layers: {_fmt_bytes(stored)} stored of "
                            f"{_fmt_bytes(saved)} if kept, {_fmt_ms(time_s)} of recompute and codec time per "
                            "micro-batch"))
    if policy.op_costs is None:
        parts.append(_prose("\nsizes unknown: the file does not keep them (written by hand, or before `adacc solve` "
                            "did) and its profile is not here; `adacc solve` again writes them into the file"))
    pred = policy.predicted
    peers: list[list[str]] = [["this policy", _fmt_bytes(pred.get("memory_bytes")), _fmt_ms(pred.get("time_s"))]]
    if profile is not None:
        peers += _peers(policy, profile)
    parts.append("\npredicted per micro-batch (memory incl. static; time = overhead over keeping everything)\n"
                 + format_table(["policy", "memory", "time"], peers, right=(1, 2)))
    return "\n".join(parts)


def _peers(policy: Policy, profile: LayerProfile) -> list[list[str]]:
    """The presets' and the paper MILP's predictions for the same profile, beside the policy's."""
    from megatron_adacc.adacc.policy.policy import PRESET_NAMES, Policy
    from megatron_adacc.adacc.policy.solver import SolveOptions, evaluate_policy, make_problem
    from megatron_adacc.adacc.policy.strategies import InfeasibleBudgetError, paper

    peers = []
    chain = bool(policy.solver.get("chain_aware", True))
    for name in PRESET_NAMES:
        try:
            ev = evaluate_policy(profile, Policy.preset(name, policy.num_layers), chain_aware=chain)
            peers.append([name, _fmt_bytes(ev["memory_bytes"]), _fmt_ms(ev["time_s"])])
        except ValueError:
            pass
    if policy.budget_bytes is not None:
        try:
            problem = make_problem(profile, policy.budget_bytes, SolveOptions(), num_layers=policy.num_layers)
            res = paper.solve(problem)
            peers.append(["paper MILP (eq. 4-8)", _fmt_bytes(res.predicted_memory_bytes),
                          _fmt_ms(res.predicted_time_s)])
        except InfeasibleBudgetError:
            peers.append(["paper MILP (eq. 4-8)", "infeasible", "-"])
    return peers
