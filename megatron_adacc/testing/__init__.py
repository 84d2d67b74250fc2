"""Helpers for tests that run real megatron-core on the CPU.

Nothing here stubs Megatron: ``build_tiny_gpt`` builds megatron-core's own ``GPTModel`` (local layer spec)
after the CPU compatibility layer is installed. megatron-core is imported inside the functions: tests/conftest.py
imports this module (for :func:`memory_cap`) before ``quiet_fallback_warnings()``, and tests that run no Megatron
should not load it.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_adacc.compat import quiet_fallback_warnings
from megatron_adacc.training.data import VOCAB_SIZE, BatchSampler
from megatron_adacc.training.distributed import free_port, initialize, set_seed

REPO_ROOT = Path(__file__).resolve().parents[2]

TINY_CONFIG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=256,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    use_cpu_initialization=True,
    masked_softmax_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    gradient_accumulation_fusion=False,
)


#: :func:`build_tiny_gpt`'s keywords for a Llama-style tiny GPT: RMSNorm, SwiGLU, rotary positions, two key/value
#: heads for the four query heads, no biases, and PyTorch's SDPA attention, whose CPU kernel has no attention
#: dropout (hidden dropout stays on).
TINY_LLAMA = dict(attention_backend="flash", attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
                  activation_func=torch.nn.functional.silu, add_bias_linear=False, num_query_groups=2,
                  position_embedding_type="rope")


@contextlib.contextmanager
def memory_cap(gib: float):
    """Cap this process's address space at ``gib`` GiB for the duration (RLIMIT_AS).

    One megatron-core configuration (selective ``mlp`` recompute with biased linears) recurses without bound
    in ``CheckpointFunction.backward``; under the cap it fails with MemoryError instead of taking the machine.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = int(gib * 2**30)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def init_distributed_single(seed: int = 1234) -> None:
    """A world of one over gloo, megatron's parallel state, CPU layer, and seeded RNG tracker (idempotent)."""
    quiet_fallback_warnings()
    initialize(torch.device("cpu"), seed)


def tiny_config(**overrides):
    """A megatron-core ``TransformerConfig`` for a 2-layer, hidden-64 GPT, with ``overrides`` applied."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{**TINY_CONFIG, **overrides})


def build_tiny_gpt(seq_length: int = 32, seed: int = 1234, *, attention_backend: str | None = None,
                   position_embedding_type: str = "learned_absolute", **config_overrides) -> torch.nn.Module:
    """megatron-core's ``GPTModel`` with the local spec (its core attention as ``--attention-backend`` names it),
    deterministic weights from ``seed``."""
    from megatron.core.models.gpt import GPTModel

    from megatron_adacc.models.attention import gpt_layer_spec

    init_distributed_single(seed)
    set_seed(seed)
    return GPTModel(
        config=tiny_config(**config_overrides),
        transformer_layer_spec=gpt_layer_spec(attention_backend),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=seq_length,
        position_embedding_type=position_embedding_type,
    )


def tiny_batch(batch_size: int = 2, seq_length: int = 32, seed: int = 0):
    """A deterministic batch from the embedded corpus: (tokens, position_ids, attention_mask, labels)."""
    b = next(BatchSampler(seq_length, batch_size, seed))
    return b.tokens, b.position_ids, b.attention_mask, b.labels


def loss_and_grads(model: torch.nn.Module, batch, rng_seed: int = 7) -> tuple[torch.Tensor, dict]:
    """One forward and backward from a fixed RNG state; returns the loss and a name -> grad copy map."""
    set_seed(rng_seed)
    model.zero_grad(set_to_none=True)
    tokens, position_ids, mask, labels = batch
    loss = model(tokens, position_ids, mask, labels=labels).float().mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def grad_rel_error(grads: dict, ref: dict) -> float:
    """Global relative gradient error ``||g - g_ref|| / ||g_ref||`` over every parameter in ``ref``."""
    diff = torch.cat([(grads[n] - ref[n]).flatten() for n in ref])
    return (diff.norm() / torch.cat([ref[n].flatten() for n in ref]).norm()).item()


def run_torchrun(script: str | Path, nproc: int = 2, args: list[str] | None = None,
                 timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` under ``torchrun --nproc_per_node nproc`` on 127.0.0.1 and return the completed process.

    Raises with the combined output when the run fails, so a test failure shows the ranks' tracebacks.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), *(args or [])]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          preexec_fn=_lift_address_space_cap)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def torchrun_results(script: str | Path, cases: list[str], nproc: int = 2, key: str = "spec",
                     timeout: float = 600) -> dict[str, dict]:
    """Run a torchrun worker over ``cases`` and collect the ``RESULT {json}`` lines it prints, by ``result[key]``;
    a case without its line fails, with the end of the output."""
    proc = run_torchrun(script, nproc=nproc, args=cases, timeout=timeout)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            out[result[key]] = result
    assert sorted(out) == sorted(cases), proc.stdout[-3000:]
    return out


def _lift_address_space_cap() -> None:
    """Children of a capped test get their own, larger cap: the test's :func:`memory_cap` guards against a
    runaway in the test process, while torchrun's launcher and ranks reserve address space (threads, gloo
    buffers) that a cap sized for one tiny model in one process can refuse, which aborts a rank (SIGABRT)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


@contextlib.contextmanager
def not_restored(owner: type, method: str):
    """Within the block, ``owner.method`` (a ``load_state_dict``-like method) restores nothing: a resume test's
    negative control, which must then differ from the straight run."""
    original = getattr(owner, method)
    setattr(owner, method, lambda self, state: None)
    try:
        yield
    finally:
        setattr(owner, method, original)


def exit_torchrun_worker(code: int = 0) -> None:
    """End a torchrun test worker after its results are printed: every rank meets at a barrier (none tears
    gloo down while another still talks to it), then the process leaves without interpreter teardown, where
    a joinable C++ thread left by DDP's reducer makes static destruction call std::terminate (SIGABRT)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
