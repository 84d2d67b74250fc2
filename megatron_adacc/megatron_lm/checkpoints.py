"""Feature state in Megatron-LM checkpoints: ResiReduce residuals, the evolved Adacc policy, GACT's bit widths.

Megatron-LM saves the model, optimizer and RNG states in one of its formats (``torch``, ``torch_dist``...); the
features' own state (each extension's ``state_dict``) goes beside it, one file per rank, whatever the format::

    <save>/iter_0000005/megatron_adacc/rank00001.pt

It is written right after Megatron's ``save_checkpoint`` returns and read right after ``load_checkpoint`` (inside
``setup_model_and_optimizer``), once the extensions are set up. The files hold tensors, numbers, strings and
containers only, and are read with ``torch.load(weights_only=True)``: loading a checkpoint never runs code.
A checkpoint saved without megatron-adacc (or with other features) resumes with fresh feature state, and says so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from megatron_adacc.core.errors import AdaccError
from megatron_adacc.core.extension import TrainingExtension
from megatron_adacc.core.files import atomic_write

#: Bumped when the file's layout changes; a newer file is refused rather than misread.
FORMAT = 1
FOLDER = "megatron_adacc"


class CheckpointStateError(AdaccError, RuntimeError):
    """A megatron-adacc state file of a checkpoint cannot be used."""


def state_path(root: str | os.PathLike, iteration: int, rank: int) -> Path:
    """Where ``rank``'s feature state of checkpoint ``iteration`` lives (Megatron names its folders
    ``iter_%07d``)."""
    return Path(root) / f"iter_{iteration:07d}" / FOLDER / f"rank{rank:05d}.pt"


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def save(extensions: list[Any], root: str | os.PathLike, iteration: int,
         host: dict[str, Any] | None = None) -> Path | None:
    """Write this rank's extension states (and the host's own, ``host``) for checkpoint ``iteration``,
    atomically; None when there is nothing to save."""
    states = {getattr(e, "name", type(e).__name__): e.state_dict() for e in extensions}
    states = {name: state for name, state in states.items() if state}
    if not states and not host:
        return None
    data = {"format": FORMAT, "iteration": iteration, "extensions": states, "host": host or {}}
    return atomic_write(state_path(root, iteration, _rank()), lambda f: torch.save(data, f))


def load(extensions: list[Any], root: str | os.PathLike, iteration: int, log=print) -> dict[str, Any]:
    """Restore the extension states saved with checkpoint ``iteration``; returns the host's own state."""
    path = state_path(root, iteration, _rank())
    if not path.exists():
        # Those that keep state at all, found without building their state dicts (residual copies) for a message.
        stateful = [e for e in extensions if type(e).state_dict is not TrainingExtension.state_dict]
        if stateful:
            log(f"megatron-adacc: checkpoint {root} (iteration {iteration}) holds no megatron-adacc state for this "
                f"rank; {', '.join(getattr(e, 'name', type(e).__name__) for e in stateful)} start afresh")
        return {}
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: name it instead of a pickle traceback
        raise CheckpointStateError(f"{path} is not a readable megatron-adacc state file ({exc}); delete it to "
                                   "resume with fresh feature state, or load another checkpoint") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointStateError(f"{path} has format {data.get('format') if isinstance(data, dict) else '?'}, "
                                   f"this megatron-adacc reads format {FORMAT}; use the megatron-adacc that "
                                   "wrote it")
    restored = []
    for extension in extensions:
        name = getattr(extension, "name", type(extension).__name__)
        if name in data["extensions"]:
            extension.load_state_dict(data["extensions"][name])
            restored.append(name)
    unused = sorted(set(data["extensions"]) - set(restored))
    if unused:
        log(f"megatron-adacc: {path} also holds state of {', '.join(unused)}, not enabled in this run; ignored")
    return dict(data.get("host") or {})
