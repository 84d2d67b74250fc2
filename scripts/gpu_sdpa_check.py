"""Adacc on the SDPA attention where the kernel takes attention dropout (a GPU): exact, and at or below Megatron's
full recompute. The CPU tests cover the rest; the CPU kernel has no attention dropout, so there the replay of a
``context`` op that draws is only tested on SDPA's reference math.

On the Llama-style model (RMSNorm, SwiGLU, RoPE, GQA; ``configs/llama-tiny.toml`` shrunk) with attention and hidden
dropout 0.1, one forward and backward each, from the same RNG state:

* stock twice (the kernels' own determinism, which every comparison below needs);
* every op kept through the decomposition, every single op recomputed (``context`` replays the kernel's dropout),
  a segment across the attention: bit-identical to stock;
* the ``recompute`` preset: bit-identical to Megatron's full recompute, holding the same bytes per layer;
* the layer input compressed and everything recomputed: fewer bytes than full recompute.

Prints one line per check and a JSON summary; exit status 0 when every check passed, 1 otherwise.

    python scripts/gpu_sdpa_check.py [--device cuda] [--attention-dropout 0.1] [adacc train flags, e.g. --bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))

SHAPE = ["--config", "llama-tiny", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--hidden-dropout", "0.1"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention-dropout", default="0.1")
    opts, extra = parser.parse_known_args()
    # the comparisons are bit for bit: cuBLAS's deterministic workspace, set before CUDA starts
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    import torch
    from _runtime_helpers import (
        decisions,
        grads_equal,
        megatron_full_recompute,
        megatron_full_recompute_held,
        policy_of,
    )

    import megatron_adacc
    from megatron_adacc.adacc.policy.ops import OP_NAMES
    from megatron_adacc.adacc.runtime import memory_report
    from megatron_adacc.testing import loss_and_grads
    from megatron_adacc.training import model as model_lib
    from megatron_adacc.training.args import parse_train_args
    from megatron_adacc.training.data import sampler_for

    torch.use_deterministic_algorithms(True, warn_only=True)
    args = parse_train_args(SHAPE + ["--device", opts.device, "--attention-dropout", opts.attention_dropout] + extra)
    device, config, model = model_lib.model_in_this_process(args)
    b = next(sampler_for(args)).to(device)
    batch = (b.tokens, b.position_ids, b.attention_mask, b.labels)
    results: dict[str, object] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                  "torch": torch.__version__, "attention_dropout": float(opts.attention_dropout),
                                  "flags": extra}

    def under(policy):
        megatron_adacc.install(config, policy)
        try:
            out = loss_and_grads(model, batch)
            return out, [row["measured_bytes"] for row in memory_report()["layers"]]
        finally:
            megatron_adacc.uninstall()

    def same(a, b) -> bool:
        return bool(torch.equal(a[0], b[0])) and grads_equal(a[1], b[1]) == []

    stock = loss_and_grads(model, batch)
    results["stock_is_deterministic"] = same(stock, loss_and_grads(model, batch))
    results["keep_equals_stock"] = same(under(policy_of([decisions(compress={"scores": "int4_asymmetric"})] * 2))[0],
                                        stock)
    differing = [op for op in OP_NAMES[1:] if not same(under(policy_of([decisions(recompute=(op,))] * 2))[0], stock)]
    results["single_op_recompute_differs"] = differing
    across = policy_of([decisions(recompute=("linear_qkv", "scores", "softmax", "dropout", "context", "linear_proj"))]
                       * 2)
    results["attention_segment_equals_stock"] = same(under(across)[0], stock)
    full = megatron_full_recompute(model, batch)
    held = megatron_full_recompute_held(model, batch)
    preset, measured = under("recompute")
    results["recompute_equals_megatron_full"] = same(preset, full)
    results["megatron_full_bytes"], results["recompute_preset_bytes"] = held, measured
    floor = {**decisions(recompute=OP_NAMES[1:]), "layer_input": decisions(compress={"layer_input": "int4_outlier"})[
        "layer_input"]}
    (floor_loss, _), floor_bytes = under(policy_of([floor] * 2))
    results["floor_bytes"] = floor_bytes
    results["floor_loss_equals_stock"] = bool(torch.equal(floor_loss, stock[0]))

    checks = {
        "stock is deterministic": results["stock_is_deterministic"],
        "keep through the ops == stock": results["keep_equals_stock"],
        "every single-op recompute == stock": not differing,
        "a segment across the attention == stock": results["attention_segment_equals_stock"],
        "recompute preset == Megatron full recompute": results["recompute_equals_megatron_full"],
        "recompute preset holds Megatron's bytes": measured == held,
        "compressed input + recompute holds less": all(f < h for f, h in zip(floor_bytes, held)),
        "compression leaves the loss as it is": results["floor_loss_equals_stock"],
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    results["checks"] = checks
    print(json.dumps(results, default=str))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
