"""Adacc: per saved activation of a transformer layer, keep, compress to INT4, or recompute.

Three parts, each importing only the ones before it:

* :mod:`.policy` — the pure decision part: the layer's ops and actions, policies and their files, profiles,
  the cost model, Pareto fronts and the MILP strategies. No torch module is run here;
* :mod:`.runtime` — the execution part: one megatron-core ``TransformerLayer`` run op by op under a policy;
* :mod:`.integration` — the Megatron glue: ``install`` / dispatch, configuration checks, ``auto`` (profile and
  solve), evolution during training, the profiler, and the training extension.

The feature's entry in the plugin registry is :mod:`.feature`.
"""
