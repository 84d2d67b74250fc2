"""Build megatron-core's GPTModel (local layer spec), its DDP wrapper and optimizer from `adacc train` args.

megatron-core is imported inside the functions: :mod:`.loop` imports this module, and `adacc train --help`, its
refusals and the torchrun workers (which import the loop before ``quiet_fallback_warnings()``) must not wait for
megatron-core or print its import-time notices.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from megatron_adacc.core.devices import resolve_device
from megatron_adacc.core.errors import IntegrationError
from megatron_adacc.models import backend_kind, dropout_problem
from megatron_adacc.training.corpus import model_vocab


def transformer_config(args: SimpleNamespace, device: torch.device):
    """A megatron-core ``TransformerConfig`` with the meaning Megatron-LM gives the same flags."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        # Megatron-LM's pair: --num-query-groups counts only under --group-query-attention (default 1 there)
        num_query_groups=(args.num_query_groups or 1) if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        add_bias_linear=not args.disable_bias_linear,
        gated_linear_unit=bool(args.swiglu),
        bf16=bool(args.bf16),
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_cpu_initialization=device.type == "cpu",
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        deterministic_mode=bool(args.deterministic_mode),
        # The fused kernels need CUDA extensions; their unfused fallbacks compute the same thing.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if args.swiglu:
        kwargs["activation_func"] = torch.nn.functional.silu
    if args.recompute_modules is not None:
        kwargs["recompute_modules"] = list(args.recompute_modules)
    return TransformerConfig(**kwargs)


def check_supported(args: SimpleNamespace) -> None:
    """Refuse configurations megatron-core itself cannot run here, naming the flag to change."""
    if (args.recompute_granularity == "selective" and "mlp" in (args.recompute_modules or [])
            and not args.disable_bias_linear):
        raise IntegrationError(
            "--recompute-granularity selective with --recompute-modules mlp and biased linears makes "
            "megatron-core 0.16/0.19 recurse without bound in CheckpointFunction.backward (the fc2 bias "
            "Parameter is returned through the checkpoint). Add --disable-bias-linear or drop 'mlp'."
        )
    dropout = dropout_problem(backend_kind(args.attention_backend), args.attention_dropout,
                              resolve_device(args.device).type)
    if dropout:
        raise IntegrationError(dropout)
    if args.recompute_granularity == "full" and not args.recompute_method:
        raise IntegrationError("--recompute-granularity full needs --recompute-method uniform or block "
                         "(and --recompute-num-layers), as in Megatron-LM.")


def build_gpt(args: SimpleNamespace, config) -> torch.nn.Module:
    """megatron-core's ``GPTModel``: the local layer with the core attention ``--attention-backend`` names."""
    from megatron.core.models.gpt import GPTModel

    from megatron_adacc.models.attention import gpt_layer_spec

    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(args.attention_backend),
        vocab_size=model_vocab(args),
        max_sequence_length=args.seq_length,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def model_in_this_process(args: SimpleNamespace) -> tuple[torch.device, object, torch.nn.Module]:
    """``(device, config, model)`` for a script or benchmark that runs the model ``args`` describe outside the
    training loop: this process's groups and seeds set up as ``adacc train`` sets them, the model on its device in
    training mode."""
    from megatron_adacc.training import distributed

    device = distributed.resolve_device(args.device)
    distributed.initialize(device, args.seed)
    config = transformer_config(args, device)
    model = build_gpt(args, config).to(device)
    model.train()
    return device, config, model


def wrap_ddp(args: SimpleNamespace, config, model: torch.nn.Module):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bool(args.overlap_grad_reduce),
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        bucket_size=None if not args.overlap_grad_reduce else args.ddp_bucket_size,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(args: SimpleNamespace, ddp_model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
        bf16=bool(args.bf16),
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
    )
    return get_megatron_optimizer(opt_config, [ddp_model])


def lr_at(args: SimpleNamespace, iteration: int) -> float:
    """Linear warm-up then cosine decay to --min-lr, like Megatron-LM's default scheduler."""
    warmup = args.lr_warmup_iters or 0
    if iteration <= warmup:
        return args.lr * iteration / max(1, warmup)
    progress = (iteration - warmup) / max(1, args.train_iters - warmup)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
