"""GPU check of `adacc plan`'s sizes: megatron-core's layer (bf16, dropout on, unfused softmax) run on a GPU and
measured by the runtime's recorder, by a saved-tensor meter around megatron's own forward and by the allocator,
beside the planner's fake-tensor sizes for a GPU (``target="cuda"``), for GPT-345M and GPT-4.7B layers.

Expected: per op equal, except the two LayerNorms, whose per-token mean and rstd a GPU keeps in fp32 where the CPU
kernel the fake run takes keeps them in bf16 (4 more bytes a token each). Needs megatron-core where it runs:
``PYTHONPATH=$PWD python scripts/gpu_plan_check.py`` prints JSON (and writes it to $OUT when set).
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch

LAYERS = {"gpt-345m": (1024, 16, 1024, 4), "gpt-4.7b": (3072, 24, 1024, 1)}  # hidden, heads, sequence, micro-batch


def check(hidden: int, heads: int, seq: int, batch: int) -> dict:
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_adacc.adacc.planner.layout import Layout
    from megatron_adacc.adacc.planner.sizing import FakeModel, fake_tensors
    from megatron_adacc.adacc.runtime import profile_layer_sizes
    from megatron_adacc.core.saved import SavedTensorMeter
    from megatron_adacc.models.attention import gpt_layer_spec

    cfg = TransformerConfig(num_layers=24, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
                            hidden_dropout=0.1, attention_dropout=0.1, bf16=True, params_dtype=torch.bfloat16,
                            masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                            gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)
    args = SimpleNamespace(seq_length=seq, micro_batch_size=batch, position_embedding_type="learned_absolute",
                           attention_backend=None, adacc_outlier_z=None)
    layer = build_module(gpt_layer_spec(None), config=cfg, layer_number=1).cuda().train()
    x = torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(seq, seq, dtype=torch.bool, device="cuda").triu(1)[None, None]
    gpu = profile_layer_sizes(layer, x, mask, None)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with SavedTensorMeter(list(layer.parameters())) as meter:
        y = layer(hidden_states=x, attention_mask=mask)[0]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
    with fake_tensors("cuda"):
        planned = FakeModel(args, cfg, Layout(), "cuda", masked_softmax_fusion=False).sizes(batch)[0]
    return {"ops": {op: {"gpu": gpu.ops[op].saved_bytes, "planned": planned.ops[op].saved_bytes} for op in gpu.ops},
            "gpu_total": sum(o.saved_bytes for o in gpu.ops.values()),
            "planned_total": sum(o.saved_bytes for o in planned.ops.values()),
            "meter_stock_forward": meter.nbytes - mask.untyped_storage().nbytes(),
            "allocated_held_stock_forward": allocated, "tokens": seq * batch}


def main() -> int:
    sys.path.insert(0, os.getcwd())
    from megatron_adacc.compat import process

    process.initialize(torch.device("cuda"), 1234)
    out = {name: check(*shape) for name, shape in LAYERS.items()}
    text = json.dumps(out, indent=1)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_plan_check.json"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
