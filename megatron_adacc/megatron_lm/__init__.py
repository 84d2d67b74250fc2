"""Glue into Megatron-LM's ``pretrain_gpt.py``: what ``patches/`` calls.

The upstream patch (``patches/``, applied by ``scripts/apply_patches.sh``) only does three things::

    import megatron_adacc.megatron_lm as adacc_megatron_lm
    args = parse_and_validate_args(extra_args_provider=adacc_megatron_lm.extra_args_provider(<existing>), ...)
    adacc_megatron_lm.configure(args)

Everything else (flag checks, the Adacc runtime, ResiReduce, GACT, AdamA, the training-loop hooks) lives here.
With every flag off (``--adacc-policy none``, the default) :func:`configure` installs nothing. See
``docs/megatron-lm.md``.
"""

from megatron_adacc.megatron_lm.arguments import add_our_args, extra_args_provider
from megatron_adacc.megatron_lm.features import (
    FEATURES,
    Feature,
    FeatureUnavailable,
    IntegrationError,
    check_combination,
    enabled_features,
)
from megatron_adacc.megatron_lm.session import (
    Session,
    attach,
    configure,
    current_session,
    install_training_hooks,
    reset,
    uninstall_training_hooks,
)

__all__ = [
    "FEATURES",
    "Feature",
    "FeatureUnavailable",
    "IntegrationError",
    "Session",
    "add_our_args",
    "attach",
    "check_combination",
    "configure",
    "current_session",
    "enabled_features",
    "extra_args_provider",
    "install_training_hooks",
    "reset",
    "uninstall_training_hooks",
]
