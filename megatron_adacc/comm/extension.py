"""`adacc train --resireduce SCHEME`: attach the compressed reduction to Megatron DDP and report it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_adacc.comm.megatron_ddp import MegatronAttachment, attach
from megatron_adacc.comm.options import DEFAULTS, ReducerOptions
from megatron_adacc.comm.pipeline import build_reducer
from megatron_adacc.core.extension import TrainingContext, TrainingExtension
from megatron_adacc.core.log import get_logger
from megatron_adacc.core.saved import unique_storage_bytes


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    found = []
    for child in getattr(optimizer, "chained_optimizers", []) or []:
        found += _torch_optimizers(child)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        found += _torch_optimizers(inner)
    return found


def measure_model_state(ddp_models: list, optimizer: Any, residual_bytes: int = 0,
                        owner_residual_bytes: int = 0) -> dict[str, int]:
    """Bytes of the model states (ResiReduce Sect. 3): parameters, gradient buffers, optimizer states (incl.
    fp32 main copies) and residuals (the ranks' and, under the reduce-scatter transport, the owners'), each
    counted once by the storages actually allocated."""
    seen: set[int] = set()
    params = grads = 0
    for ddp in ddp_models:
        module = getattr(ddp, "module", ddp)
        params += unique_storage_bytes(module.parameters(), seen)
        for buf in list(getattr(ddp, "buffers", []) or []) + list(
            getattr(ddp, "expert_parallel_buffers", []) or []
        ):
            grads += unique_storage_bytes([buf.grad_data], seen)
            if getattr(buf, "param_data", None) is not None:
                params += unique_storage_bytes([buf.param_data], seen)
    opt_bytes = 0
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            opt_bytes += unique_storage_bytes(group["params"], seen)
        for state in opt.state.values():
            opt_bytes += unique_storage_bytes(state.values(), seen)
    return {
        "param_bytes": params,
        "grad_bytes": grads,
        "optimizer_state_bytes": opt_bytes,
        "residual_bytes": residual_bytes,
        "owner_residual_bytes": owner_residual_bytes,
        "model_state_bytes": params + grads + opt_bytes + residual_bytes + owner_residual_bytes,
    }


class ResiReduceExtension(TrainingExtension):
    """Compressed gradient reduction with the residual scheme of ``--resireduce``.

    Residuals are per rank: ``state_dict`` carries this rank's residuals (and the stochastic compressors'
    generator state), and the training loop saves one checkpoint file per rank.
    """

    name = "resireduce"

    def __init__(self, scheme: str, options: ReducerOptions = DEFAULTS, seed: int = 0, **overrides: Any):
        """``overrides`` replace single fields of ``options`` (``ResiReduceExtension("w", density=0.1)``)."""
        options = dataclasses.replace(options, **overrides)
        self.scheme, self.compressor_name = scheme, options.compressor
        self.options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name != "compressor"}
        self.seed = seed
        self.attachment: MegatronAttachment | None = None
        self.ctx: TrainingContext | None = None
        self.rank, self.world = 0, 1

    @classmethod
    def from_args(cls, args: Any) -> ResiReduceExtension:
        return cls(args.resireduce, ReducerOptions.from_args(args), seed=getattr(args, "seed", 0) or 0)

    def setup(self, ctx: TrainingContext) -> None:
        if torch.distributed.is_initialized():
            self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        # Stochastic compressors (dgc, qsgd) draw per rank: one seed on every rank would correlate errors.
        reducer = build_reducer(
            self.scheme, self.compressor_name, seed=self.seed * 1000 + self.rank, **self.options
        )
        self.attachment = attach(ctx.ddp_model, reducer)
        self.ctx = ctx
        if self.world == 1:
            get_logger("resireduce").info(
                f"one process: nothing is communicated, but gradients are still compressed with error feedback "
                f"({self.scheme}, {self.compressor_name}), so training differs from --resireduce off")

    def on_step_end(self, iteration: int, loss: float) -> None:
        if self.attachment is not None:
            self.attachment.reducer.traffic.end_step()

    def state_dict(self) -> dict:
        if self.attachment is None:
            return {}
        return {
            "rank": self.rank,
            "world_size": self.world,
            "scheme": self.scheme,
            "reducer": self.attachment.reducer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if self.attachment is None:
            raise RuntimeError(
                "ResiReduce: load_state_dict before setup(); the loop must set up extensions first"
            )
        if state.get("scheme") != self.scheme:
            raise ValueError(
                f"checkpoint was saved with --resireduce {state.get('scheme')}, not {self.scheme}"
            )
        if (state.get("rank"), state.get("world_size")) != (self.rank, self.world):
            raise ValueError(
                f"ResiReduce residuals are per rank: checkpoint is rank {state.get('rank')} of "
                f"{state.get('world_size')}, this process is rank {self.rank} of {self.world}"
            )
        self.attachment.reducer.load_state_dict(state["reducer"])

    def report(self) -> dict[str, Any]:
        if self.attachment is None:
            return {}
        reducer = self.attachment.reducer
        memory = reducer.memory
        traffic = reducer.traffic
        steps = traffic.per_step[1:] or traffic.per_step  # the first step of overlap runs reduces late
        sent = int(sum(m.sent for m in steps) / len(steps)) if steps else 0
        received = int(sum(m.received for m in steps) / len(steps)) if steps else 0
        transports = sorted(set(reducer.transports().values()))
        out: dict[str, Any] = {
            "scheme": self.scheme,
            "grad_compressor": self.compressor_name,
            "transport": "+".join(transports) or None,
            "residual_bytes": memory.residual_bytes(),
            "residual_formula_bytes": memory.formula_bytes(),
            "owner_residual_bytes": reducer.residual_bytes() - memory.residual_bytes(),
            "bytes_sent_per_step": sent,
            "bytes_received_per_step": received,
            "uncompressed_bytes_per_step": self.attachment.uncompressed_bytes_per_step,
            "communication_ratio": (self.attachment.uncompressed_bytes_per_step / sent) if sent else None,
        }
        plan = getattr(memory, "plan", None)
        if plan is not None:
            out["reusable_groups"] = len(plan.groups)
            out["specific_layers"] = len(plan.specific)
        if self.ctx is not None:
            out.update(measure_model_state(self.ctx.ddp_model, self.ctx.optimizer, memory.residual_bytes(),
                                           out["owner_residual_bytes"]))
        return out


def build_extension(args: Any) -> ResiReduceExtension | None:
    """The extension for ``--resireduce`` (None when it is ``off``)."""
    if getattr(args, "resireduce", "off") == "off":
        return None
    return ResiReduceExtension.from_args(args)
