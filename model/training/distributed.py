"""Several training processes (``torchrun``: PyTorch's DistributedDataParallel): this process's
place among them and the few collective steps the trainer takes. One process is the same code
with every collective a no-op, so one config trains on one process or many.

    torchrun --nproc-per-node 2 -m model.training.train --config my.toml --out runs/my

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous (MASTER_ADDR, MASTER_PORT); the
process group is gloo on CPU and NCCL on GPUs (``backend_for``), nothing else differs.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# How long a collective waits for the other processes: rank 0 validates (greedy BLEU) and writes
# checkpoints while the others wait for it at the next collective.
TIMEOUT = datetime.timedelta(hours=2)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class Processes:
    """This process's rank among ``world`` training processes (``local`` on its machine)."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @classmethod
    def from_env(cls) -> Processes:
        """torchrun's RANK, WORLD_SIZE and LOCAL_RANK (one process without them)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        if not 0 <= rank < world:
            raise ValueError(f"RANK {rank} outside WORLD_SIZE {world}")
        return cls(rank, world, local)

    @property
    def main(self) -> bool:
        """Rank 0: the one process that writes the run folder (checkpoints, logs, state)."""
        return self.rank == 0

    @property
    def many(self) -> bool:
        return self.world > 1

    def start(self, device: torch.device) -> None:
        """Join the process group (several processes only; once)."""
        if self.many and not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend_for(device), timeout=TIMEOUT)

    def stop(self) -> None:
        if self.many and dist.is_initialized():
            dist.destroy_process_group()

    def _device(self) -> torch.device:
        """Where collective tensors live: the GPU under NCCL, else the CPU."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the processes (float64)."""
        if not self.many:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self._device())
        dist.all_reduce(tensor)
        return [float(v) for v in tensor.cpu()]

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` (anything picklable), in every process."""
        if not self.many:
            return obj
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=0, device=self._device())
        return box[0]

    def gather(self, obj: T) -> list[T]:
        """Every process's ``obj`` in rank order (on every process)."""
        if not self.many:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_to_main(self, obj: T) -> list[T] | None:
        """Every process's ``obj`` in rank order, on rank 0 (None elsewhere)."""
        if not self.many:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.many:
            dist.barrier()
