"""``adacc profile``, ``adacc solve`` and ``adacc show``: the policy maker on the command line.

``profile`` and ``solve`` take the same model flags and ``--config`` as ``adacc train``, so the signature
they profile and solve for is the one training will check.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING

from megatron_adacc.core.errors import ArgumentParser, UsageError, refusal_boundary
from megatron_adacc.core.units import format_bytes, parse_positive_bytes, positive_int
from megatron_adacc.training.args import add_train_args, parse_train_args

# The policy code (and torch under it) is imported by the functions that use it, after the command line is
# parsed: a refused command line answers at once. The Megatron glue is imported later still (see cmd_profile).
if TYPE_CHECKING:
    from megatron_adacc.adacc.policy.policy import Policy
    from megatron_adacc.adacc.policy.profile import LayerProfile


def _fmt_bytes(n: float | None) -> str:
    return format_bytes(n, digits=2)


def _fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3f} ms"


# ------------------------------------------------------------------------------------------ parsers
def _model_parser(prog: str, description: str) -> argparse.ArgumentParser:
    return add_train_args(ArgumentParser(prog=prog, description=description))


def _add_profile_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("adacc profile")
    g.add_argument("--refresh", "--force", dest="force", action="store_true",
                   help="Profile again even if the database has this model (the newest profile is the one used): "
                        "after a profile measured under contention, or a change of machine load or software.")
    g.add_argument("--repeats", type=positive_int, default=3,
                   help="Timed repetitions per measurement (median; more while they disagree).")


def _add_solve_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("adacc solve")
    g.add_argument("--budget", type=parse_positive_bytes, default=None, metavar="BYTES",
                   help="Memory budget (e.g. 12GiB); same as --adacc-memory-budget.")
    g.add_argument("--output", "-o", default="adacc-policy.json", help="Where to write the policy file.")
    # Not --adacc-codecs: beside the training flag --adacc-codec (a codec family) that name read as its plural.
    # The destination stays adacc_codecs, which SolveOptions.from_args reads.
    g.add_argument("--candidate-codecs", dest="adacc_codecs", choices=("default", "all"), default="default",
                   help="Which profiled codecs the MILP may choose per op. default: each op's layer-specific "
                        "codec (the paper); all: every codec that applies to the op.")
    g.add_argument("--analytic", action="store_true",
                   help="Solve from shape formulas instead of a measured profile (no model run; a first guess).")


def _add_show_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("policy", help="A policy file written by `adacc solve`.")
    p.add_argument("--all-layers", action="store_true", help="One table per layer instead of per group.")


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> SimpleNamespace:
    return parse_train_args(argv, parser, feature_flags_need_feature=False)


def main(argv: list[str]) -> int:
    """``adacc profile|solve|show ...`` (``argv[0]`` is the command) behind the ``adacc`` command's error
    boundary: a refusal is one line on stderr and exit status 2."""
    return refusal_boundary(run, argv)


def run(argv: list[str]) -> int:
    """:func:`main` without the boundary: refusals propagate as exceptions (``adacc`` calls this)."""
    command, rest = argv[0], argv[1:]
    if command == "show":
        p = ArgumentParser(prog="adacc show", description="Print a policy file as a per-op table.")
        _add_show_flags(p)
        return cmd_show(p.parse_args(rest))
    if command == "profile":
        p = _model_parser("adacc profile", "Profile one transformer layer of the configured model.")
        _add_profile_flags(p)
        return cmd_profile(_parse(p, rest))
    if command == "solve":
        p = _model_parser("adacc solve", "Solve Adacc's MILP for a memory budget and write a policy file.")
        _add_solve_flags(p)
        return cmd_solve(_parse(p, rest))
    raise UsageError(f"unknown policy command {command!r}; the policy commands are profile, solve and show")


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
    # The Megatron glue (integration, the runtime, megatron-core) is imported by the commands that use it, so
    # that `adacc show` and `--help` do not load it.
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    ProfileDB(getattr(args, "adacc_profile_db", None))  # a database that cannot be used stops us before Megatron
    from megatron_adacc.adacc.integration.auto import get_or_make_profile
    from megatron_adacc.training import distributed

    device, config = _config(args)
    distributed.initialize(device, getattr(args, "seed", 1234))
    profile, ref = get_or_make_profile(args, config, force=args.force, log=lambda m: print(m, file=sys.stderr))
    print(render_profile(profile))
    print(f"profile #{ref['id']} in {ref['db']}")
    return 0


def cmd_solve(args: SimpleNamespace) -> int:
    from megatron_adacc.adacc.policy.io import save_policy
    from megatron_adacc.adacc.policy.profile import analytic_profile
    from megatron_adacc.adacc.policy.profile_db import ProfileDB
    from megatron_adacc.adacc.policy.signature import model_signature
    from megatron_adacc.adacc.policy.solver import SolveOptions, solve_policy

    if not args.analytic:
        ProfileDB(getattr(args, "adacc_profile_db", None))  # as in cmd_profile
    from megatron_adacc.adacc.integration.profiler import device_memory_bytes  # lazy: see cmd_profile

    device, config = _config(args)
    budget = args.budget or getattr(args, "adacc_memory_budget", None) or device_memory_bytes(device)
    options = SolveOptions.from_args(args)
    if args.analytic:
        profile, ref = analytic_profile(model_signature(config, args)), None
    else:
        from megatron_adacc.adacc.integration.auto import get_or_make_profile
        from megatron_adacc.training import distributed

        distributed.initialize(device, getattr(args, "seed", 1234))
        profile, ref = get_or_make_profile(args, config, log=lambda m: print(m, file=sys.stderr))
    policy, result = solve_policy(profile, budget, options, profile_ref=ref, signature=model_signature(config, args))
    path = save_policy(policy, args.output)
    print(render_policy(policy, profile))
    print(f"wrote {path} ({result.strategy}, {result.status}, solved in {result.solve_time_s * 1e3:.0f} ms)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from megatron_adacc.adacc.policy.io import load_policy
    from megatron_adacc.adacc.policy.profile_db import ProfileDB

    policy = load_policy(args.policy)
    profile = ProfileDB.referenced(policy.profile)  # a policy file names what to read, never where to write
    print(render_policy(policy, profile, all_layers=getattr(args, "all_layers", False)))
    return 0


# ------------------------------------------------------------------------------------------ rendering
def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def render_profile(profile: LayerProfile) -> str:
    rows = []
    for op in profile.ops:
        best = min(op.codecs.items(), key=lambda kv: kv[1].compressed_bytes, default=None)
        rows.append([op.name, best[0] if best else "-", _fmt_bytes(op.saved_bytes), _fmt_ms(op.forward_time_s),
                     f"{best[1].compressed_bytes / op.saved_bytes:.3f}" if best and op.saved_bytes else "-",
                     _fmt_ms(best[1].compress_time_s + best[1].decompress_time_s) if best else "-"])
    head = (f"profile of {profile.device} ({profile.source}); signature {json.dumps(profile.signature)}\n"
            f"static {_fmt_bytes(profile.static_bytes)}, workspace {_fmt_bytes(profile.workspace_bytes)}, "
            f"per-layer input {_fmt_bytes(profile.layer_fixed_bytes)}\n"
            f"times below are micro-benchmarks; in the runtime the cost model scales codec times by "
            f"{profile.codec_time_scale:.2f} and recompute times by {profile.recompute_time_scale:.2f}, and charges "
            f"{_fmt_ms(profile.runtime_overhead_s)} per layer that does not keep everything (the runtime's own "
            "cost)\n")
    return head + _table(rows, ["op", "smallest codec", "saved", "recompute", "crate", "c+dc time"])


def _groups(policy: Policy, all_layers: bool) -> list[tuple[str, int]]:
    """(label, representative layer) per run of identical consecutive layers."""
    out, start = [], 0
    for i in range(1, policy.num_layers + 1):
        if i == policy.num_layers or all_layers or policy.layers[i] != policy.layers[start]:
            out.append((f"layer {start}" if i - 1 == start else f"layers {start}-{i - 1}", start))
            start = i
    return out


def render_policy(policy: Policy, profile: LayerProfile | None = None, *, all_layers: bool = False) -> str:
    from megatron_adacc.adacc.policy.ops import OP_NAMES

    parts = [f"policy {policy.name or '-'}: {policy.num_layers} layers, budget {_fmt_bytes(policy.budget_bytes)}, "
             f"solver {policy.solver.get('strategy', '-')} ({policy.solver.get('status', '-')})"]
    for label, first in _groups(policy, all_layers):
        rows = []
        for i, (op, d) in enumerate(zip(OP_NAMES, policy.layers[first])):
            saved = stored = cost = None
            if profile is not None:
                o = profile.ops[i]
                saved = o.saved_bytes
                if d.action == "keep":
                    stored, cost = o.saved_bytes, 0.0
                elif d.action == "recompute":
                    stored, cost = 0, o.forward_time_s
                elif d.codec in o.codecs:
                    c = o.codecs[d.codec]
                    stored, cost = c.compressed_bytes, c.compress_time_s + c.decompress_time_s
            params = ",".join(f"{k}={v}" for k, v in sorted(d.codec_params.items()))
            rows.append([op, d.label + (f" ({params})" if params else ""), _fmt_bytes(saved), _fmt_bytes(stored),
                         _fmt_ms(cost)])
        parts.append(f"\n{label}\n" + _table(rows, ["op", "decision", "saved if kept", "stored", "time cost"]))
    pred = policy.predicted
    peers: list[list[str]] = [["this policy", _fmt_bytes(pred.get("memory_bytes")), _fmt_ms(pred.get("time_s"))]]
    if profile is not None:
        peers += _peers(policy, profile)
    parts.append("\npredicted per micro-batch (memory incl. static; time = overhead over keeping everything)\n"
                 + _table(peers, ["policy", "memory", "time"]))
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
