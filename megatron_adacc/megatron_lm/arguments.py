"""Our flags on Megatron-LM's parser: chain :func:`megatron_adacc.arguments.add_adacc_args` after the provider
``pretrain_gpt.py`` already passes.

``parse_and_validate_args`` accepts a single ``extra_args_provider``. Upstream already uses it for NVIDIA
ModelOpt's flags, so replacing it would silently drop those; :func:`extra_args_provider` returns one callable
that runs the existing provider first and then adds ours.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from megatron_adacc.core.patching import mark

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

#: Marker set on the parser once our group is added, so chaining twice (e.g. a script that already wraps the
#: provider) does not make argparse fail on duplicate flags.
_ADDED_MARKER = "__megatron_adacc_args_added__"


def add_our_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every megatron-adacc flag (and only those) to ``parser``; a second call is a no-op.

    A clash with a flag the parser already has (a Megatron-LM release that grew a flag with one of our names)
    is reported with both names instead of argparse's bare "conflicting option string".
    """
    if getattr(parser, _ADDED_MARKER, False):
        return parser
    from megatron_adacc.arguments import add_adacc_args

    probe = add_adacc_args(argparse.ArgumentParser(add_help=False))
    ours = {opt for action in probe._actions for opt in action.option_strings}
    clash = sorted(ours & set(parser._option_string_actions))
    if clash:
        raise RuntimeError(
            f"Megatron-LM already defines {', '.join(clash)}, which megatron-adacc also adds. This "
            "Megatron-LM checkout is newer than the ones megatron-adacc was checked against "
            "(docs/megatron-lm.md names them); use a supported commit or report the clash."
        )
    parser = add_adacc_args(parser)
    setattr(parser, _ADDED_MARKER, True)
    return parser


def extra_args_provider(existing: ArgsProvider | None = None) -> ArgsProvider:
    """Return a provider for ``parse_and_validate_args`` that runs ``existing`` (may be None), then ours."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if existing is not None:
            returned = existing(parser)
            # Megatron's contract is "return the parser"; tolerate providers that mutate and return None.
            parser = parser if returned is None else returned
        return add_our_args(parser)

    return mark(provider, existing)
