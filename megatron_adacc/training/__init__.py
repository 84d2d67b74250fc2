"""`adacc train`: megatron-core GPT training on a text corpus, every feature behind its flag (the registry,
:mod:`megatron_adacc.features`); the extension protocol it drives is :mod:`megatron_adacc.core.extension`."""
