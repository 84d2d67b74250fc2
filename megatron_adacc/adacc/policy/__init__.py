"""Adacc's decision half: per-op policies, policy files, the profile database, the MILP, and evolution.

Main entry points:

* :class:`Policy`, :class:`Decision` — per-layer, per-op decisions; presets ``all_keep``, ``all_recompute``,
  ``quantize_all``;
* :func:`load_policy` / :func:`save_policy` — versioned JSON files (``policy.schema.json``);
* :func:`model_signature` — what makes a policy or profile valid for a model;
* :func:`megatron_adacc.adacc.policy.solver.solve_policy` — profile + budget → policy (MILP strategies in
  :mod:`megatron_adacc.adacc.policy.strategies`);
* :func:`megatron_adacc.adacc.integration.auto.make_policy` — ``--adacc-policy auto``;
* :mod:`megatron_adacc.adacc.integration.evolution` — adaptive policy evolution during training.
"""

from megatron_adacc.adacc.policy.io import PolicySchemaError, load_policy, save_policy
from megatron_adacc.adacc.policy.ops import OP_NAMES, OPS, OpSpec, op_spec
from megatron_adacc.adacc.policy.policy import PRESET_NAMES, Decision, Policy
from megatron_adacc.adacc.policy.signature import SignatureMismatchError, model_signature

__all__ = [
    "OP_NAMES", "OPS", "OpSpec", "op_spec", "Decision", "Policy", "PRESET_NAMES", "PolicySchemaError",
    "load_policy", "save_policy", "SignatureMismatchError", "model_signature",
]
