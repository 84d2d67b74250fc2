"""``configs/*.toml`` (the `adacc train` format) as a Megatron-LM command line.

One file describes a model for both entry points: ``adacc train --config gpt-345m`` reads it directly, and
``pretrain_gpt.py $(python -m megatron_adacc.megatron_lm.configs gpt-345m)`` gets the same values as flags.
Keys are Megatron-LM flag names with ``_`` for ``-``, so the translation is mechanical: ``true`` becomes the
bare flag, ``false`` is left out (every boolean key is a Megatron ``store_true`` flag), anything else becomes
``--flag value``. Megatron-LM needs ``--max-position-embeddings`` with learned positions; it defaults to the
sequence length. Megatron-LM's local layer ignores ``--attention-backend``: a config whose backend is PyTorch's
SDPA (``flash``, ``fused``) also gets the ``--spec`` that builds that layer
(:data:`megatron_adacc.models.SDPA_SPEC_FLAG`).

Usage: ``python -m megatron_adacc.megatron_lm.configs CONFIG [--set KEY=VALUE ...]`` prints the flags,
shell-quoted, on one line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from megatron_adacc.core import config_files
from megatron_adacc.core.errors import InputNotFound
from megatron_adacc.models import SDPA, SDPA_SPEC_FLAG, backend_kind


def resolve(name: str | Path) -> Path:
    """A path, or a name in ``configs/`` (``gpt-345m`` -> ``configs/gpt-345m.toml``)."""
    path = config_files.find(name)
    if path is None:
        known = ", ".join(config_files.known())
        raise InputNotFound(f"no config {name!r}: not a file and not in {config_files.config_dir()} "
                                f"(known: {known})")
    return path


def load(name: str | Path) -> dict[str, Any]:
    path = resolve(name)
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from exc


def to_argv(values: dict[str, Any]) -> list[str]:
    """Megatron-LM flags for a config's key/value pairs (see the module docstring)."""
    values = dict(values)
    learned = values.get("position_embedding_type", "learned_absolute") == "learned_absolute"
    if learned and "seq_length" in values:
        values.setdefault("max_position_embeddings", values["seq_length"])
    argv: list[str] = []
    if "attention_backend" in values and backend_kind(values["attention_backend"]) == SDPA and "spec" not in values:
        argv += SDPA_SPEC_FLAG
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif isinstance(value, (int, float, str)):
            argv += [flag, str(value)]
        else:
            raise ValueError(f"config key {key!r}: cannot turn a {type(value).__name__} into a flag")
    return argv


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: keep it as a string
    return key.replace("-", "_"), value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_adacc.megatron_lm.configs",
                                     description="Print a configs/*.toml file as Megatron-LM flags.")
    parser.add_argument("config", help="a TOML file or a name in configs/ (e.g. gpt-345m)")
    parser.add_argument("--set", action="append", type=_parse_override, default=[], metavar="KEY=VALUE",
                        help="override or add a key (TOML value syntax), e.g. --set micro_batch_size=16")
    parser.add_argument("--drop", action="append", default=[], metavar="KEY", help="leave a key out")
    ns = parser.parse_args(argv)
    values = load(ns.config)
    values.update(dict(ns.set))
    for key in ns.drop:
        values.pop(key.replace("-", "_"), None)
    print(shlex.join(to_argv(values)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
