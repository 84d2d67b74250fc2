"""``adacc plan``: what a model holds on a GPU under a parallel layout, and what fits, computed here without one.

The layer is megatron-core's own, built on fake tensors as one rank of the layout builds it and run through the
Adacc runtime's decomposition (:mod:`.sizing`); times come from a roofline of every kernel on a GPU of the device
table (:mod:`.roofline`, :data:`megatron_adacc.core.devices.GPUS`); the model states from the model built on the
meta device (:mod:`megatron_adacc.adacc.integration.model_states`). :mod:`.plan` compares Megatron's recompute
modes, the paper's Quantization and Adacc on the solver's own cost model, per pipeline stage.
"""
