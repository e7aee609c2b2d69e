"""Starting and stopping a job's training processes on one node. The worker's own process is rank
0 (it holds the job's lease, reports and checkpoints); ranks 1..N-1 are started here with
torch.multiprocessing (spawned, so nothing of the worker's state is shared by accident) and only
compute. A follower watches its parent: when rank 0 is gone, it exits."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workers.training.distributed.group import ProcessGroup, RankLost, Rendezvous

log = logging.getLogger(__name__)

STOP = "stop"  # the command that ends a follower's loop
ERROR_FILE = "rank-{rank}.error"  # a follower's last words, for rank 0's event


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


class TrainingProcesses:
    """Rank 0's view of the job's processes: starts the followers, joins their group, tells which
    one died, and stops them."""

    def __init__(self, rendezvous: Rendezvous, follow: Callable[..., Any], payload: Any, work_dir: Path) -> None:
        import torch.multiprocessing as mp

        self.rendezvous, self.work_dir = rendezvous, Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(1, rendezvous.world_size):
            (self.work_dir / ERROR_FILE.format(rank=rank)).unlink(missing_ok=True)
        context = mp.get_context("spawn")
        self.processes = [context.Process(target=_follower_main, name=f"agent-rft-rank-{rank}", daemon=True,
                                          args=(rank, rendezvous, follow, payload, str(self.work_dir), os.getpid()))
                          for rank in range(1, rendezvous.world_size)]
        for process in self.processes:
            process.start()
        self.group: ProcessGroup | None = None
        self.failed = False  # a rank was lost: the others may be stuck in a collective, not listening

    def join_group(self) -> ProcessGroup:
        """Rank 0's membership (blocks until every follower has joined, or the timeout)."""
        if self.rendezvous.backend == "nccl":
            import torch

            torch.cuda.set_device(0)
        try:
            self.group = ProcessGroup(self.rendezvous, 0, describe_loss=self.lost)
        except (RuntimeError, ValueError) as exc:
            raise self.lost() or RankLost(None, f"the training processes did not meet: {exc}") from exc
        return self.group

    def lost(self) -> RankLost | None:
        """The follower that ended, and how (waiting a moment: a closed connection is often seen
        before the process's exit)."""
        self.failed = True
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            for rank, process in enumerate(self.processes, start=1):
                if process.exitcode is not None:
                    return RankLost(rank, self._how_it_ended(rank, process.exitcode))
            time.sleep(0.1)
        return RankLost(None, f"no answer within {self.rendezvous.timeout_s:g} s: a training process hangs "
                              "(every process is still running)")

    def _how_it_ended(self, rank: int, exitcode: int) -> str:
        if exitcode < 0:
            how = f"killed by {signal.Signals(-exitcode).name}"
        else:
            how = f"exited with code {exitcode}"
        error_file = self.work_dir / ERROR_FILE.format(rank=rank)
        if error_file.is_file():
            how += f": {error_file.read_text(encoding='utf-8').strip()[-1000:]}"
        return how

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell the followers to stop (when none was lost: a broadcast to a hung rank would wait for
        it), then make sure they are gone."""
        if self.group is not None and not self.failed:
            try:
                self.group.command(STOP)
            except RankLost:
                pass
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5.0)
        if self.group is not None:
            self.group.close()


def _follower_main(rank: int, rendezvous: Rendezvous, follow: Callable[..., Any], payload: Any, work_dir: str,
                   parent_pid: int) -> None:
    """A follower process: join the group, then `follow(group, payload)` until rank 0 says stop."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        if rendezvous.backend == "nccl":
            import torch

            torch.cuda.set_device(rank)
        group = ProcessGroup(rendezvous, rank)
        try:
            follow(group, payload)
        finally:
            group.close()
    except BaseException as exc:
        Path(work_dir, ERROR_FILE.format(rank=rank)).write_text(f"{type(exc).__name__}: {exc}", encoding="utf-8")
        log.error("training process rank %d failed:\n%s", rank, traceback.format_exc())
        raise


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)  # rank 0 is gone (killed): nothing to follow


async def serve_commands(group: ProcessGroup, handler: Any) -> None:
    """A follower's loop: each command rank 0 broadcasts, `(name, args)`, runs `handler.name(*args)`
    (awaited when it is a coroutine) on this rank too, until STOP."""
    import inspect

    while True:
        name, args = group.next_command()
        if name == STOP:
            return
        result = getattr(handler, name)(*args)
        if inspect.isawaitable(result):
            await result
