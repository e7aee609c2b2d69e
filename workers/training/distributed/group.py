"""The training processes of one job, as the trainer sees them: its rank, how many there are, and
the few collectives a data-parallel step needs. `OneProcess` is today's single process (every
collective is the identity); `ProcessGroup` is torch.distributed's, NCCL on GPUs and gloo on CPUs,
with a gloo group of its own for the Python objects rank 0 sends (commands, rollouts, statistics).

A collective that cannot complete (a rank died, or did not answer within the group's timeout)
raises `RankLost`, naming the rank and why, instead of hanging."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class RankLost(RuntimeError):
    """A training process died or stopped answering: the step cannot complete."""

    def __init__(self, rank: int | None, reason: str) -> None:
        super().__init__(f"training process rank {rank}: {reason}" if rank is not None else reason)
        self.rank, self.reason = rank, reason


class TrainingGroup(Protocol):
    rank: int
    world_size: int

    def command(self, name: str, *args: Any) -> None: ...  # rank 0: the followers run `name(*args)` too
    def gather(self, obj: Any) -> list[Any] | None: ...  # every rank's object, on rank 0 (None elsewhere)
    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None: ...  # summed over ranks
    def broadcast_parameters(self, module: torch.nn.Module) -> None: ...  # rank 0's weights everywhere


class OneProcess:
    """A job trained in one process."""

    rank, world_size = 0, 1

    def command(self, name: str, *args: Any) -> None:
        return None

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        return None

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        return None


@dataclass
class Rendezvous:
    """Where the processes of one job meet (one node: 127.0.0.1) and how long a collective may wait."""

    port: int
    world_size: int
    timeout_s: float
    backend: str  # "nccl" | "gloo"
    address: str = "127.0.0.1"


class ProcessGroup:
    """torch.distributed's process group of one job. The gradient all-reduce runs on the default
    group (NCCL on GPUs); objects go through a gloo group, which needs no device."""

    def __init__(self, rendezvous: Rendezvous, rank: int, describe_loss: Callable[[], RankLost | None] | None = None
                 ) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = rank, rendezvous.world_size
        self.describe_loss = describe_loss  # rank 0: which follower died, from its process
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        dist.init_process_group(rendezvous.backend, init_method=f"tcp://{rendezvous.address}:{rendezvous.port}",
                                rank=rank, world_size=rendezvous.world_size, timeout=timeout)
        self.objects = dist.new_group(backend="gloo", timeout=timeout) if rendezvous.backend != "gloo" else None
        # Followers wait for rank 0's next command while it grades, evaluates and reports, for as
        # long as that takes: that wait has no timeout of its own (a follower exits when rank 0 dies).
        self.commands = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))

    def _guarded(self, collective: Callable[[], T]) -> T:
        try:
            return collective()
        except (RuntimeError, ValueError) as exc:  # DistBackendError, DistNetworkError, a gloo timeout
            lost = self.describe_loss() if self.describe_loss else None
            raise (lost or RankLost(None, f"a collective failed: {exc}")) from exc

    def command(self, name: str, *args: Any) -> None:
        import torch.distributed as dist

        self._guarded(lambda: dist.broadcast_object_list([(name, args)], src=0, group=self.commands))

    def next_command(self) -> tuple[str, tuple[Any, ...]]:
        """A follower: the next `(name, args)` rank 0 sends."""
        import torch.distributed as dist

        box = [None]
        self._guarded(lambda: dist.broadcast_object_list(box, src=0, group=self.commands))
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        import torch.distributed as dist

        out = [None] * self.world_size if self.rank == 0 else None
        self._guarded(lambda: dist.gather_object(obj, out, dst=0, group=self.objects))
        return out

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks in one flat buffer (a rank that had no
        sequence this step adds zeros), as DDP's reducer does once gradient accumulation ends."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        flat = _flatten_dense_tensors(grads)
        self._guarded(lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM))
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Rank 0's trainable weights on every rank, as DDP does when it wraps a module."""
        import torch.distributed as dist

        with torch.no_grad():
            for param in (p for p in module.parameters() if p.requires_grad):
                self._guarded(lambda p=param: dist.broadcast(p.data, src=0))

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def shares(items: Sequence[T], world_size: int, *, weight: Callable[[T], int] = lambda _item: 1) -> list[list[T]]:
    """`items` in `world_size` contiguous shares of about equal total weight, in order (so that
    joining the shares gives `items` back)."""
    total = sum(weight(item) for item in items)
    out: list[list[T]] = [[] for _ in range(world_size)]
    seen, rank = 0, 0
    for item in items:
        while rank < world_size - 1 and seen >= total * (rank + 1) / world_size:
            rank += 1
        out[rank].append(item)
        seen += weight(item)
    return out
