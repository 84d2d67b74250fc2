"""Adacc's Megatron glue: ``install`` routes megatron-core's full-recompute entry point through the runtime.

See :mod:`.dispatch` for how; :mod:`.checks` refuses configurations the runtime cannot run; :mod:`.auto` makes a
policy for ``--adacc-policy auto``; :mod:`.evolution` re-solves it during training from the outlier statistics
:mod:`.outlier_probe` samples; :mod:`.profiler` measures the costs the solver reads, on the layer and inputs
:mod:`.sample` builds; :mod:`.extension` joins the training hosts, and :mod:`.planning` decides where ``auto``
plans (in a forked child on the CPU, whose budget is the training process's peak RSS).
"""

from megatron_adacc.adacc.integration.dispatch import (
    UnsupportedConfigError,
    build_extension,
    check_config,
    check_layer,
    entry_points,
    install,
    installed_policy,
    is_installed,
    uninstall,
)

__all__ = ["install", "uninstall", "is_installed", "installed_policy", "build_extension", "UnsupportedConfigError",
           "check_config", "check_layer", "entry_points"]
