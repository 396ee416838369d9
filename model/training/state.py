"""Resumable training state and checkpoint averaging, stored as safetensors + JSON (no pickle)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model.checkpoint import assign, unique_state
from model.network.transformer import Transformer

TENSORS, SCALARS = "state.safetensors", "state.json"


def save_state(
    folder: Path,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scalars: dict[str, Any],
    rng: Sequence[dict[str, torch.Tensor]] | None = None,
) -> None:
    """Model, optimizer moments, scheduler position and RNG state, in one file written
    atomically (the scalars in its metadata; ``state.json`` beside it for people to read), so a
    process killed at any moment leaves the previous state or the new one. ``rng``: each training
    process's RNG state (``rng_state()``), in rank order; default this process's."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v for k, v in unique_state(model).items()}
    opt = optimizer.state_dict()
    for index, state in opt["state"].items():
        for key, value in state.items():
            tensors[f"optim.{index}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    for rank, states in enumerate(rng or [rng_state()]):
        for name, value in states.items():
            tensors[f"rng.{name}" if rank == 0 else f"rng.{name}.{rank}"] = value
    groups = [{k: v for k, v in g.items()} for g in opt["param_groups"]]
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    text = json.dumps({**scalars, "param_groups": groups, "scheduler": sched})
    tmp = folder / (TENSORS + ".tmp")
    save_file(tensors, str(tmp), metadata={"scalars": text})
    tmp.replace(folder / TENSORS)
    tmp = folder / (SCALARS + ".tmp")
    tmp.write_text(text)
    tmp.replace(folder / SCALARS)


def rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG state: the CPU generator's, and the current GPU's where there is one."""
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def read_state(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What ``save_state`` wrote: (tensors, scalars)."""
    file = folder / TENSORS
    tensors = load_file(str(file))
    with safe_open(str(file), framework="pt") as f:
        text = (f.metadata() or {}).get("scalars")
    return tensors, json.loads(text if text is not None else (folder / SCALARS).read_text())


def apply_state(
    tensors: dict[str, torch.Tensor],
    scalars: dict[str, Any],
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rank: int = 0,
) -> dict[str, Any]:
    """Restore a state read by ``read_state`` into this process (rank ``rank``'s RNG, where the
    state has it: False is returned under "rng_restored" where it does not); -> the scalars."""
    scalars = dict(scalars)
    device = next(model.parameters()).device
    assign(model, {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}, "state")
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value if key == "step" else value.to(device)
    optimizer.load_state_dict({"state": state, "param_groups": scalars.pop("param_groups")})
    scheduler.load_state_dict({**scalars.pop("scheduler"), "lr_lambdas": [None]})
    suffix = "" if rank == 0 else f".{rank}"
    scalars["rng_restored"] = f"rng.cpu{suffix}" in tensors
    if scalars["rng_restored"]:
        torch.set_rng_state(tensors[f"rng.cpu{suffix}"])
    if f"rng.cuda{suffix}" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors[f"rng.cuda{suffix}"])
    return scalars


def load_state(
    folder: Path, model: Transformer, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> dict[str, Any]:
    """Restore what ``save_state`` wrote into this one process; returns the scalars."""
    tensors, scalars = read_state(folder)
    return apply_state(tensors, scalars, model, optimizer, scheduler)


def average_files(files: Sequence[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of the floating-point tensors of several safetensors files."""
    if not files:
        raise ValueError("nothing to average")
    total: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            value = tensor.double() if tensor.is_floating_point() else tensor
            total[name] = total[name] + value if name in total and tensor.is_floating_point() else value
    return {k: (v / len(files)).float() if v.is_floating_point() else v for k, v in total.items()}
