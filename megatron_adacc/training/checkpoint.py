"""``adacc train``'s checkpoints: one state file and one manifest per rank, checked before anything is loaded.

    <dir>/rank00000.pt     model, optimizer, data sampler, every RNG (CPU, CUDA, Megatron's tracker), extensions
    <dir>/rank00000.json   manifest: format, iteration, SHA-256 of the .pt, the model's parameter shapes, the
                           enabled features and optimizer, versions

Loading checks the manifest first, then the checksum, the model and the features, and only then reads the state
file, with ``torch.load(weights_only=True)``: a checkpoint never runs code, and a damaged or foreign one is
refused in one line that says what differs. Both files are written to unpredictable temporary names in the target
folder and renamed into place, so a crash mid-save leaves the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from megatron_adacc.core.errors import AdaccError, InputNotFound
from megatron_adacc.core.files import atomic_write

FORMAT = 1


class CheckpointError(AdaccError, RuntimeError):
    """A checkpoint cannot be loaded into this run: damaged, foreign, or saved with other features."""


def paths(directory: str | os.PathLike, rank: int) -> tuple[Path, Path]:
    stem = Path(directory) / f"rank{rank:05d}"
    return stem.with_suffix(".pt"), stem.with_suffix(".json")


class _Hashing:
    """A write-only file that hashes what passes through: the checksum costs no second read of the file."""

    def __init__(self, f, digest) -> None:
        self._f, self._digest = f, digest

    def write(self, data) -> int:
        self._digest.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    return {name: list(t.shape) for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}


def identity(model: torch.nn.Module, optimizer: Any, extensions: list[Any]) -> dict[str, Any]:
    """What a checkpoint must match to be loaded into this run."""
    names = {getattr(e, "name", type(e).__name__): getattr(e, "state_optional", False) for e in extensions}
    return {"model": model_shapes(model), "optimizer": type(optimizer).__name__,
            "features": sorted(n for n, optional in names.items() if not optional),
            "optional_features": sorted(n for n, optional in names.items() if optional)}


def rng_states(device: torch.device) -> dict[str, Any]:
    """Every generator a step draws from: dropout inside Megatron's RNG tracker, the default CPU (and CUDA) one."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, Any], device: torch.device) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(states["cpu"])
    get_cuda_rng_tracker().set_states(states["tracker"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def save(directory: str | os.PathLike, rank: int, iteration: int, state: dict[str, Any],
         ident: dict[str, Any]) -> Path:
    """Write ``state`` (tensors, numbers, strings and containers) and its manifest for ``rank``."""
    state_path, manifest_path = paths(directory, rank)
    digest = hashlib.sha256()
    atomic_write(state_path, lambda f: torch.save({"iteration": iteration, **state}, _Hashing(f, digest)))
    manifest = {"format": FORMAT, "iteration": iteration, "sha256": digest.hexdigest(), **ident,
                "versions": {"torch": torch.__version__, "megatron_adacc": _version()}}
    atomic_write(manifest_path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    return state_path


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-adacc")
    except Exception:  # an uninstalled checkout
        return "unknown"


def _differences(saved: dict[str, Any], ident: dict[str, Any]) -> list[str]:
    found = []
    # Extensions whose state is optional (core.extension.TrainingExtension.state_optional) may differ; a
    # manifest written before that distinction lists them among its features.
    optional = set(saved.get("optional_features") or []) | set(ident.get("optional_features") or [])
    features = [f for f in saved.get("features") or [] if f not in optional]
    if saved.get("optimizer") != ident["optimizer"] or features != ident["features"]:
        found.append(f"it was saved with optimizer {saved.get('optimizer')} and features "
                     f"{', '.join(features) or 'none'}; this run has {ident['optimizer']} and "
                     f"{', '.join(ident['features']) or 'none'} (use the same --adama / --resireduce / --gact-level; "
                     "--adacc-policy may change between runs)")
    mine, theirs = ident["model"], saved.get("model") or {}
    if mine != theirs:
        missing = sorted(set(mine) - set(theirs))
        shapes = [n for n in sorted(set(mine) & set(theirs)) if mine[n] != theirs[n]]
        detail = (f"{shapes[0]} is {theirs[shapes[0]]} there and {mine[shapes[0]]} here" if shapes else
                  f"it has no {missing[0]}" if missing else f"it has {sorted(set(theirs) - set(mine))[0]} too")
        found.append(f"it is a checkpoint of another model: {detail} (same --config and model flags as the run "
                     "that saved it)")
    return found


#: The manifest's fields the checks read, and their JSON types.
_MANIFEST_TYPES = {"iteration": int, "sha256": str, "optimizer": str, "features": list, "model": dict}


def saved_iteration(directory: str | os.PathLike) -> int:
    """The iteration the checkpoint in ``directory`` was written at (rank 0's manifest; nothing is loaded)."""
    _, manifest_path = paths(directory, 0)
    try:
        iteration = json.loads(manifest_path.read_text()).get("iteration")
    except FileNotFoundError:
        raise InputNotFound(f"{directory}: no checkpoint manifest {manifest_path.name} there; name a folder "
                            "`adacc train --save` wrote") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{manifest_path}: not a readable manifest ({exc})") from None
    if not isinstance(iteration, int) or isinstance(iteration, bool):
        raise CheckpointError(f"{manifest_path}: no iteration in it; name a folder `adacc train --save` wrote")
    return iteration


def _malformed(manifest: dict[str, Any]) -> str | None:
    """The first field of ``manifest`` the checks could not read (a hand-edited or damaged manifest)."""
    for name, kind in _MANIFEST_TYPES.items():
        if not isinstance(manifest.get(name), kind) or isinstance(manifest.get(name), bool):
            return name
    if not all(isinstance(f, str) for f in manifest["features"]):
        return "features"
    optional = manifest.get("optional_features", [])
    if not isinstance(optional, list) or not all(isinstance(f, str) for f in optional):
        return "optional_features"
    return None


def load(directory: str | os.PathLike, rank: int, ident: dict[str, Any]) -> dict[str, Any]:
    """The checked state of ``rank`` (see the module docstring), or a :class:`CheckpointError` naming the
    problem and the fix."""
    state_path, manifest_path = paths(directory, rank)
    where = f"--load {directory}"
    if not state_path.exists():
        raise InputNotFound(f"{where}: no checkpoint {state_path.name} for rank {rank} there")
    if not state_path.is_file():
        raise CheckpointError(f"{where}: {state_path.name} is not a file; name a folder `adacc train --save` wrote")
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{where}: {manifest_path.name} is missing, so {state_path.name} cannot be checked; "
                              "it was not written by this version of adacc train") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{where}: {manifest_path.name} is not a readable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else "?"
        raise CheckpointError(f"{where}: manifest format {found}, this version reads format {FORMAT}")
    malformed = _malformed(manifest)
    if malformed:
        raise CheckpointError(f"{where}: {manifest_path.name}: field {malformed!r} is not what adacc train writes "
                              "(edited or damaged); load another checkpoint")
    if _sha256(state_path) != manifest.get("sha256"):
        raise CheckpointError(f"{where}: {state_path.name} does not match its manifest's checksum (damaged, or "
                              "its save was interrupted); load an earlier checkpoint")
    problems = _differences(manifest, ident)
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))
    try:
        with warnings.catch_warnings():  # torch warns about a pickle it is about to refuse; the refusal says it
            warnings.simplefilter("ignore")
            state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{where}: {state_path.name} cannot be read safely ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0]})") from None
    if state.get("iteration") != manifest.get("iteration"):
        raise CheckpointError(f"{where}: {state_path.name} is of iteration {state.get('iteration')}, its manifest "
                              f"of {manifest.get('iteration')} (an interrupted save); load an earlier checkpoint")
    return state
