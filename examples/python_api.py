"""megatron_adacc.install on a megatron-core GPTModel trained by your own loop.

    python examples/python_api.py            # CPU: about 20 s on 2 cores; CUDA when there is a GPU

One call picks, for every activation the layers save for backward, keep, INT4 or recompute under the budget
(``policy="auto"``: one layer is profiled once and the costs are cached; the MILP is solved for this model and
micro-batch). Everything else is plain megatron-core and PyTorch.
"""

import logging

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

import megatron_adacc
from megatron_adacc.compat.process import initialize

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # what `auto` does, as it goes
SEQ, MICRO_BATCH, VOCAB = 128, 4, 1024
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# torch.distributed and Megatron's parallel state (a world of one here; torchrun sets the rest). On a CPU this
# also turns on megatron-adacc's CUDA-as-CPU layer, which megatron-core needs there.
initialize(device, seed=1234)

config = TransformerConfig(num_layers=4, hidden_size=128, num_attention_heads=4, hidden_dropout=0.1,
                           attention_dropout=0.1, use_cpu_initialization=device.type == "cpu",
                           masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                           gradient_accumulation_fusion=False)
model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                 max_sequence_length=SEQ).to(device)

policy = megatron_adacc.install(model, "auto", budget="8GiB", micro_batch_size=MICRO_BATCH)
print(f"policy: {policy.summary()}")

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=device), diagonal=1)[None, None]
positions = torch.arange(SEQ, device=device)[None].expand(MICRO_BATCH, -1)
model.train()
for step in range(5):
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), device=device)
    loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss.item():.3f}")

megatron_adacc.uninstall()
