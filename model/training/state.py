"""Resumable training state and checkpoint averaging, stored as safetensors + JSON (no pickle)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
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
) -> None:
    """Model, optimizer moments, scheduler position and RNG state; written atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v for k, v in unique_state(model).items()}
    opt = optimizer.state_dict()
    for index, state in opt["state"].items():
        for key, value in state.items():
            tensors[f"optim.{index}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    groups = [{k: v for k, v in g.items()} for g in opt["param_groups"]]
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    tmp = folder / (TENSORS + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(folder / TENSORS)
    (folder / SCALARS).write_text(json.dumps({**scalars, "param_groups": groups, "scheduler": sched}))


def load_state(
    folder: Path, model: Transformer, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> dict[str, Any]:
    """Restore what ``save_state`` wrote; returns the scalars."""
    tensors = load_file(str(folder / TENSORS))
    scalars = json.loads((folder / SCALARS).read_text())
    device = next(model.parameters()).device
    assign(model, {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}, str(folder))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value if key == "step" else value.to(device)
    optimizer.load_state_dict({"state": state, "param_groups": scalars.pop("param_groups")})
    scheduler.load_state_dict({**scalars.pop("scheduler"), "lr_lambdas": [None]})
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return scalars


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
