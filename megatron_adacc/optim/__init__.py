"""AdamA (Adam accumulation, seed 004): a plain torch optimizer, its data-parallel state sync, and the
Megatron wiring used by ``adacc train --adama`` (:mod:`megatron_adacc.optim.megatron`)."""

from megatron_adacc.optim.adama import AdamA
from megatron_adacc.optim.meter import LiveGradientMeter

__all__ = ["AdamA", "LiveGradientMeter"]
