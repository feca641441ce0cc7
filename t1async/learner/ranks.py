"""Start, watch and stop the distributed learner's ranks 1..N-1 (rank 0 is ``learner serve`` itself).

    ranks = Ranks(RanksConfig(nproc=2))
    trainer = ranks.start(learner.trainer)    # blocks until every rank joined; returns a DistributedTrainer
    ...  await ranks.watch()                  # raises RankFailedError when a rank exits
    ranks.close(trainer)                      # stop message, then SIGTERM/SIGKILL by PID to what is left

Each rank is ``python -m t1async.learner.ranks --rank i ...``, a child of rank 0 that gets SIGTERM if rank 0
dies (PR_SET_PDEATHSIG) and ignores SIGINT (a Ctrl-C reaches rank 0, which stops them in order).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import anyio
import torch
import torch.distributed as dist

from t1async.learner.distributed import DistributedTrainer, RankFailedError, collective, init_group
from t1async.learner.trainer import Trainer
from t1async.log import get_logger
from t1async.procs import popen
from t1async.protocol.errors import ConfigError
from t1async.signals import set_handlers
from t1async.transport.natsd import free_port

log = get_logger("t1async.learner.ranks")


@dataclass(frozen=True)
class RanksConfig:
    nproc: int
    threads: int = 1  # torch CPU threads per rank
    host: str = "127.0.0.1"  # where rank 0 hosts the group's TCPStore
    join_timeout_s: float = 300.0  # every rank must join within this
    # a collective may wait this long: ranks 1..N-1 wait in one for rank 0's next step, however long the
    # stream takes to fill a batch; a rank that dies closes its sockets, which fails the others at once
    group_timeout_s: float = 7 * 24 * 3600.0
    stop_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {self.nproc}")


class Ranks:
    def __init__(self, config: RanksConfig) -> None:
        self.config = config
        self.procs: list[subprocess.Popen] = []
        self.joined = False

    def start(self, trainer: Trainer) -> DistributedTrainer:
        """Start ranks 1..N-1, join the group as rank 0, and hand them the model and trainer config.
        Returns a DistributedTrainer that takes over ``trainer``'s model, optimizer and step count."""
        c = self.config
        backend = "nccl" if trainer.device.type == "cuda" else "gloo"
        port = free_port(c.host)
        for rank in range(1, c.nproc):
            argv = [
                sys.executable,
                "-m",
                "t1async.learner.ranks",
                "--rank",
                str(rank),
                "--world",
                str(c.nproc),
                "--host",
                c.host,
                "--port",
                str(port),
                "--backend",
                backend,
                "--threads",
                str(c.threads),
                "--timeout",
                str(c.group_timeout_s),
            ]
            self.procs.append(popen(argv, pdeathsig=signal.SIGTERM))
        log.info("learner.ranks_starting", nproc=c.nproc, backend=backend, port=port, pids=[p.pid for p in self.procs])
        try:
            init_group(0, c.nproc, c.host, port, backend=backend, timeout_s=c.join_timeout_s)
        except RuntimeError as exc:  # the TCPStore's wait for the ranks timed out
            codes = {p.pid: p.poll() for p in self.procs}
            raise RankFailedError(
                f"the learner's ranks did not join within {c.join_timeout_s:g} s (exit code by pid, "
                f"None = still running: {codes}); see the learner log: {exc}"
            ) from exc
        self.joined = True
        model = trainer.model
        dtype = next(model.parameters()).dtype
        dist.broadcast_object_list([(trainer.config, model.cfg, dtype)], src=0)
        dt = DistributedTrainer(model, trainer.config)
        dt.optimizer, dt.steps = trainer.optimizer, trainer.steps
        log.info("learner.ranks_joined", nproc=c.nproc, backend=backend)
        return dt

    async def watch(self) -> None:
        """Return never; raise RankFailedError as soon as a rank has exited."""
        while True:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise RankFailedError(
                        f"learner rank {i + 1} (pid {p.pid}) exited with code {p.returncode}; "
                        "the learner stops (restart it: it resumes from its checkpoint)"
                    )
            await anyio.sleep(0.5)

    def close(self, trainer: Any) -> None:
        """Stop every rank this learner started: the stop message when all are alive, then SIGTERM and
        SIGKILL by PID to any still running. Safe to call twice."""
        if self.joined and isinstance(trainer, DistributedTrainer) and all(p.poll() is None for p in self.procs):
            try:
                trainer.stop_ranks()
            except RankFailedError as exc:
                log.warning("learner.ranks_stop_failed", error=str(exc))
        for p in self.procs:
            try:
                p.wait(self.config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(self.config.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.joined:
            dist.destroy_process_group()
            self.joined = False
        if self.procs:
            log.info("learner.ranks_stopped", codes=[p.returncode for p in self.procs])
        self.procs = []


def rank_main(argv: list[str] | None = None) -> int:
    """Ranks 1..N-1: join, get the model and config from rank 0, train its steps until told to stop."""
    p = argparse.ArgumentParser(prog="python -m t1async.learner.ranks", description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=RanksConfig.group_timeout_s)
    args = p.parse_args(argv)
    set_handlers({signal.SIGINT: signal.SIG_IGN})
    from t1async.log import configure

    configure()
    torch.set_num_threads(max(1, args.threads))
    from t1async.learner import memory
    from t1async.model.moe import MoETransformer

    memory.bound_malloc()  # as rank 0: freed tensors go back to the kernel (learner/memory.py)

    init_group(args.rank, args.world, args.host, args.port, backend=args.backend, timeout_s=args.timeout)
    try:
        box: list[Any] = [None]
        collective("getting the model from rank 0", dist.broadcast_object_list, box, src=0)
        tcfg, mcfg, dtype = box[0]
        model = MoETransformer(mcfg).to(dtype)
        if args.backend == "nccl":
            torch.cuda.set_device(args.rank % torch.cuda.device_count())
            model = model.cuda()
        log.info("learner.rank_ready", rank=args.rank, world=args.world, pid=os.getpid())
        DistributedTrainer(model, tcfg).serve_rank()
    except RankFailedError as exc:
        log.error("learner.rank_failed", rank=args.rank, error=str(exc))
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
