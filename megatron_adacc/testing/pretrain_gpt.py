"""GPT pretraining through Megatron-LM's real ``megatron.training.pretrain``, with megatron-adacc as the patch adds it.

    python -m megatron_adacc.testing.pretrain_gpt [--stock] MEGATRON_FLAGS... [--adacc-*/--resireduce/...]
    torchrun --nproc_per_node 2 -m megatron_adacc.testing.pretrain_gpt ...

megatron-core's wheel (0.19.2) ships Megatron-LM's ``megatron.training`` package but not ``pretrain_gpt.py``,
and CI cannot fetch a checkout. This module is the project's own stand-in for that script, for the GPT
pretraining path our users run (mock or real data, tensor / pipeline / data parallelism; no SFT, FIM, context
parallelism, multi-token prediction or ModelOpt, which it refuses by name). It does what the patched
``pretrain_gpt.py`` does:

1. ``parse_and_validate_args(extra_args_provider=adacc_megatron_lm.extra_args_provider(None), ...)``;
2. ``adacc_megatron_lm.configure(args)``;
3. ``pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), datasets, ..., forward_step)``.

``--stock`` skips steps 1's provider and 2: that is the unpatched script, the reference of the bit-identity
tests. On a machine without a GPU the CPU harness (:mod:`megatron_adacc.testing.megatron_lm_cpu`) is installed
before Megatron is imported.

``ADACC_E2E_RECORD=PATH`` records every iteration's exact loss and gradient norm, and each rank's features' reports
at the end (:mod:`megatron_adacc.testing.records`).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from megatron_adacc.testing.records import record_iterations, record_path, write_report

#: Megatron-LM options this entry point's batch and loss code does not implement.
_UNSUPPORTED = {"sft": "--sft", "fim_data": "--fim-data", "mtp_num_layers": "--mtp-num-layers",
                "logits_load_dir": "--logits-load-dir", "dataloader_inter_document_masking":
                "--dataloader-inter-document-masking", "hybrid_context_parallel": "--hybrid-context-parallel"}

_BATCH_KEYS = ("attention_mask", "labels", "loss_mask", "position_ids", "tokens")


def _refuse_unsupported(args: Any) -> None:
    for dest, flag in _UNSUPPORTED.items():
        if getattr(args, dest, None):
            raise SystemExit(f"megatron_adacc.testing.pretrain_gpt: {flag} is not supported by this entry point; "
                             "use a Megatron-LM checkout's pretrain_gpt.py")
    if getattr(args, "context_parallel_size", 1) != 1:
        raise SystemExit("megatron_adacc.testing.pretrain_gpt: context parallelism is not supported by this entry "
                         "point; use a Megatron-LM checkout's pretrain_gpt.py")


# ------------------------------------------------------------------------------------ data and loss


def _datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets (``MockGPTDataset`` under ``--mock-data``) built on the ranks that read data."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )

    def built_here():
        return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)

    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, built_here, config).build()


_datasets_provider.is_distributed = True  # every rank calls it; built_here() picks the readers


def _get_batch(data_iterator, vp_stage=None) -> dict[str, torch.Tensor | None]:
    """One micro-batch: read on tensor-parallel rank 0, broadcast to the other ranks of its group."""
    from megatron.core import mpu
    from megatron.core.utils import get_batch_on_this_tp_rank
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return dict.fromkeys(_BATCH_KEYS)
    batch = {}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    if tp_rank == 0:
        batch = next(data_iterator)
        # .cuda() is the identity under the CPU harness; on a GPU it moves the batch, as pretrain_gpt.py does.
        batch = {k: (v.cuda(non_blocking=True) if v is not None else None) for k, v in batch.items()}
    return get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=1, tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Summed token loss, token count, and the ``[sum, count]`` report Megatron reduces over the data-parallel
    group (the per-token average of the global batch). Like ``pretrain_gpt.py``, it hands the loss to Megatron's
    rerun state machine, which refuses NaN/Inf (and asserts that it runs inside a forward-backward pass)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        machine = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def _forward_step(data_iterator, model):
    from megatron.core.utils import get_attr_wrapped_model

    batch = _get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    stock = "--stock" in argv
    argv = [a for a in argv if a != "--stock"]
    if not torch.cuda.is_available():
        from megatron_adacc.testing import megatron_lm_cpu

        megatron_lm_cpu.install()
    sys.argv = ["pretrain_gpt.py", *argv]

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    import megatron_adacc.megatron_lm as adacc_megatron_lm

    provider = None if stock else adacc_megatron_lm.extra_args_provider(None)
    args = parse_and_validate_args(extra_args_provider=provider, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    _refuse_unsupported(args)
    if not stock:
        adacc_megatron_lm.configure(args)
    records = record_path()
    if records:
        from megatron.training import training

        record_iterations(training, records)
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, _datasets_provider, ModelType.encoder_or_decoder, _forward_step)
    session = None if stock else adacc_megatron_lm.current_session()
    if records and session is not None:
        write_report(records, session.report())


if __name__ == "__main__":
    main()
