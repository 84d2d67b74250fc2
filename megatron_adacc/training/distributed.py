"""Process-group and model-parallel set-up for `adacc train` (single process or torchrun): the same as every
process megatron-adacc starts, :mod:`megatron_adacc.compat.process`, named here for the host's callers.

megatron-core (and the CPU layer, which imports it) are imported inside those functions: `adacc train --help`
and the test helpers (:mod:`megatron_adacc.testing`, imported by every test before
``quiet_fallback_warnings()``) import this module without loading megatron-core.
"""

from megatron_adacc.compat.process import free_port, initialize, set_seed, shutdown
from megatron_adacc.core.devices import resolve_device

__all__ = ["free_port", "initialize", "resolve_device", "set_seed", "shutdown"]
