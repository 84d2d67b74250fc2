"""Check megatron-adacc against a real (patched) Megatron-LM checkout on a CPU machine, without training.

    python scripts/megatron_lm_cpu_check.py MEGATRON_DIR [FLAGS...]   # parse + validate + configure()
    python scripts/megatron_lm_cpu_check.py --list-flags MEGATRON_DIR # every Megatron-LM option string

The first form runs Megatron-LM's own ``parse_and_validate_args`` with our chained provider on a small mock-data
GPT command line plus FLAGS, then :func:`megatron_adacc.megatron_lm.configure`, and prints the parsed values of
our flags and which Megatron-LM functions were wrapped (none for ``--adacc-policy none``). The second form
regenerates ``tests/megatron_lm/data/megatron_lm_flags_<sha>.txt``.

Importing ``megatron.training`` pulls in most of Megatron-LM. On a CPU machine without triton, the modules that
import triton at load time are replaced by empty stand-ins, and on Python 3.11 ``typing.override`` (3.12) is
borrowed from typing_extensions. Nothing is trained and no GPU is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import typing
from unittest import mock

# Modules that import triton at import time; irrelevant to argument parsing.
_STUBBED = ("megatron.core.transformer.moe.ops", "megatron.core.ssm.ops")
_SMALL_GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
              "--train-iters", "5", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "128", "--transformer-impl", "local"]
_HOOKED = {"megatron.training.training": ("setup_model_and_optimizer", "train_step", "get_megatron_optimizer"),
           "megatron.training.models.dist_utils": ("_ddp_wrap",)}


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == s or name.startswith(s + ".") for s in _STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__ = []
        module.__spec__ = spec
        return module

    def exec_module(self, module):
        pass


def _import_megatron_lm(megatron_dir: str) -> None:
    # The checkout's megatron/ must win over any installed megatron-core; this repository comes next.
    sys.path.insert(0, os.path.abspath(megatron_dir))
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, _Stub())
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")


def list_flags() -> list[str]:
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return sorted(o for action in parser._actions for o in action.option_strings)


def check(flags: list[str]) -> dict:
    import importlib

    import megatron.core
    from megatron.training.arguments import parse_and_validate_args

    import megatron_adacc.megatron_lm as adacc_megatron_lm

    sys.argv = ["pretrain_gpt.py", *_SMALL_GPT, *flags]
    args = parse_and_validate_args(extra_args_provider=adacc_megatron_lm.extra_args_provider(None),
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    ours = {f.dest: getattr(args, f.dest) for f in adacc_megatron_lm.FEATURES}
    before = {(m, n): getattr(importlib.import_module(m), n) for m, names in _HOOKED.items() for n in names}
    result = {"megatron_core": megatron.core.__version__, "parsed": ours}
    try:
        session = adacc_megatron_lm.configure(args)
    except (ValueError, ImportError) as exc:
        result["refused"] = f"{type(exc).__name__}: {exc}"
        return result
    result["session"] = session.names if session else None
    result["wrapped"] = sorted(f"{m}.{n}" for (m, n), fn in before.items()
                               if getattr(importlib.import_module(m), n) is not fn)
    return result


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["--list-flags"] and len(argv) == 2:
        _import_megatron_lm(argv[1])
        print("\n".join(list_flags()))
        return 0
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    _import_megatron_lm(argv[0])
    with contextlib.redirect_stdout(sys.stderr):  # Megatron prints every argument; keep stdout to the JSON
        result = check(argv[1:])
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
