"""Stand-ins for Megatron-LM in the integration tests. Megatron-LM itself is absent here by design: these
fakes have the signatures of the ``megatron.training.training`` functions our wrappers replace."""

from __future__ import annotations

import argparse
import contextlib
import math
import types
from typing import Any

import torch

from megatron_adacc import megatron_lm
from megatron_adacc.core.extension import TrainingExtension


def megatron_args(*argv: str, **megatron_defaults: Any) -> argparse.Namespace:
    """Parse ``argv`` with our provider on a parser that knows the Megatron-LM flags the checks read."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.set_defaults(transformer_impl="local", recompute_granularity=None, fp8=None, fp4=None,
                        fine_grained_activation_offloading=False, cuda_graph_impl="none", num_experts=None,
                        use_megatron_fsdp=False, use_torch_fsdp2=False, num_distributed_optimizer_instances=1,
                        gradient_accumulation_fusion=False, overlap_grad_reduce=False,
                        use_distributed_optimizer=False, inprocess_restart=False)
    parser.set_defaults(**megatron_defaults)
    return megatron_lm.extra_args_provider(None)(parser).parse_args(list(argv))


class RecordingExtension(TrainingExtension):
    """Records every hook call; its micro-batch context installs real saved-tensor hooks and counts them."""

    name = "recording"

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.packed = 0
        self.unpacked = 0
        self.ctx = None
        self.inside = False

    def setup(self, ctx) -> None:
        self.ctx = ctx
        self.events.append(("setup",))

    @contextlib.contextmanager
    def _context(self):
        def pack(t):
            self.packed += 1
            return t

        def unpack(t):
            self.unpacked += 1
            return t

        self.events.append(("enter",))
        self.inside = True
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self.inside = False
        self.events.append(("exit",))

    def microbatch_context(self):
        return self._context()

    def on_step_begin(self, iteration: int) -> None:
        self.events.append(("begin", iteration))

    def on_step_end(self, iteration: int, loss: float) -> None:
        self.events.append(("end", iteration, None if math.isnan(loss) else round(loss, 6)))


class FakeDDP(torch.nn.Module):
    """Megatron's DDP and Float16Module keep the wrapped model as ``.module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    @contextlib.contextmanager
    def no_sync(self):
        self.in_no_sync = True
        yield
        self.in_no_sync = False
        self.no_sync_entered = getattr(self, "no_sync_entered", 0) + 1

    def zero_grad_buffer(self) -> None:
        pass

    def finish_grad_sync(self) -> None:
        pass


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(num_layers=2, hidden_size=4)
        self.weight = torch.nn.Parameter(torch.full((4,), 0.5))


def make_fake_dist_utils() -> types.ModuleType:
    """A stand-in for ``megatron.training.models.dist_utils``: ``_ddp_wrap`` wraps chunks in FakeDDP."""
    dist_utils = types.ModuleType("fake_megatron_dist_utils")

    def _ddp_wrap(model, data_parallel_random_init, ddp_config, overlap_param_gather_with_optimizer_step,
                  use_megatron_fsdp=False, use_torch_fsdp2=False, *, pg_collection=None,
                  use_layer_wise_distributed_optimizer=False, use_layer_wise_param_layout=True):
        return [FakeDDP(chunk) for chunk in model]

    dist_utils._ddp_wrap = _ddp_wrap
    return dist_utils


def make_fake_training(num_microbatches: int = 2, losses: dict | None = None,
                       dist_utils: types.ModuleType | None = None) -> types.ModuleType:
    """A stand-in for ``megatron.training.training`` with the four functions our wrappers replace.

    ``train_step`` behaves like Megatron's schedule: it calls ``forward_step_func`` once per micro-batch and
    runs each backward *after* the forward step returned, outside whatever context the forward step entered.
    """
    training = types.ModuleType("fake_megatron_training")
    training.calls = []
    training.optimizer_builds = []

    def setup_model_and_optimizer(model_type, model_provider_func=None, checkpointing_context=None, *,
                                  cfg_container=None, pg_collection=None):
        training.calls.append("setup_model_and_optimizer")
        # Like Megatron's model builder: the DDP wrapper is looked up in its module at call time.
        wrap = dist_utils._ddp_wrap if dist_utils is not None else make_fake_dist_utils()._ddp_wrap
        model = wrap([TinyModel()], False, "ddp-config", False, pg_collection=None)
        optimizer = training.get_megatron_optimizer("opt-config", model)
        return model, optimizer, "scheduler"

    def get_megatron_optimizer(config, model_chunks, config_overrides=None, use_gloo_process_groups=True,
                               dump_param_to_param_group_map=None):
        training.optimizer_builds.append(config)
        return "megatron-optimizer"

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
        training.calls.append(("train_step", iteration))
        training.seen_forward_step = forward_step_func
        for chunk in model:
            chunk.zero_grad_buffer()
        if hasattr(optimizer, "zero_grad"):
            optimizer.zero_grad()
        for _ in range(num_microbatches):
            output = forward_step_func(data_iterator, model[0])
            if isinstance(output, tuple):  # pretrain_gpt's (output_tensor, loss_func) contract
                loss_sum, num_tokens, _ = output[1](output[0])
                output = loss_sum / num_tokens
            (output / num_microbatches).backward()  # outside forward_step_func, as in Megatron's schedules
        for chunk in model:
            chunk.finish_grad_sync()
        if hasattr(optimizer, "step"):
            optimizer.step()
        reduced = losses if losses is not None else {"lm loss": torch.tensor(2.5)}
        return reduced, 0, False, False, 0, None, None, 0

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                        checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                        pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                        train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False,
                        tp_group=None, pp_group=None, dp_cp_group=None):
        training.calls.append(("save_checkpoint", iteration, non_persistent_ckpt))

    training.setup_model_and_optimizer = setup_model_and_optimizer
    training.save_checkpoint = save_checkpoint
    training.get_megatron_optimizer = get_megatron_optimizer
    training.train_step = train_step
    return training


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Like pretrain_gpt.forward_step: a forward whose backward saves tensors (x * w needs both)."""
    unwrapped = model.module if hasattr(model, "module") else model
    x = torch.arange(4, dtype=torch.float32, requires_grad=True)
    return (x * unwrapped.weight).pow(2).sum()


def batch_forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """pretrain_gpt.forward_step's contract: draws a batch, returns (output, loss_func) with a per-batch token
    count of 2, so the per-token loss is sum(batch * weight) / 2."""
    unwrapped = model.module if hasattr(model, "module") else model
    batch = next(data_iterator)
    output = (batch * unwrapped.weight).sum()
    return output, lambda out: (out, torch.tensor(2), {"lm loss": out.detach()})
