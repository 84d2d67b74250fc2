"""AdamA (Adam accumulation, seed 004): a plain torch optimizer (:mod:`.adama`), its data-parallel state sync,
its form sharded like Megatron's distributed optimizer (:mod:`.distributed`, :mod:`.layout`), the Megatron
wiring (:mod:`.megatron`, :mod:`.chunks`) and its training extension (:mod:`.extension`).

Names are imported on first use (:mod:`megatron_adacc.core.lazy`), so the feature's registry entry
(:mod:`.feature`) is cheap to import."""

from megatron_adacc.core.lazy import exports

__all__ = ["AdamA", "DistributedAdamA", "LiveGradientMeter"]
__getattr__ = exports(__name__, {"AdamA": "megatron_adacc.optim.adama",
                                 "DistributedAdamA": "megatron_adacc.optim.distributed",
                                 "LiveGradientMeter": "megatron_adacc.optim.meter"})
