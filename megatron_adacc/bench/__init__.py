"""`adacc bench NAME`: one module per benchmark, sharing :mod:`megatron_adacc.bench.harness`."""
