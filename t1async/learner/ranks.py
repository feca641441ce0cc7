"""Start, join and stop the distributed learner's ranks (design §10).

    learner serve --nproc N ...   ->  launch(argv, RanksConfig(nproc=N))
        torch.distributed's elastic launcher (what torchrun runs) starts N copies of ``learner serve``, each
        with torchrun's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; in each, ``in_torchrun()`` is true:
        rank 0: join(), then the learner service with ``make_trainer`` (the service, as with one rank)
        ranks 1..N-1: join(), then ``follow()``: build the model, run every command rank 0 sends
        every rank builds the model on the meta device, shards it and reads only its own shards of the model
        dir (``distributed.build_sharded``); with NCCL each takes its GPU (LOCAL_RANK) before its first
        collective (``join``). Several hosts: torchrun on each (design §10).

    tests and benches: ranks = Ranks(RanksConfig(nproc=2)); trainer = ranks.start(model_or_dir, config)
        this process is rank 0; ranks 1..N-1 are ``python -m t1async.learner.ranks`` children given the same
        environment torchrun gives, running the same ``follow()``; ranks.close(trainer) stops them.

A rank that dies fails the others at their next collective (its sockets close); the launcher then stops
every rank (SIGTERM, SIGKILL after ``stop_timeout_s``) and ``launch`` raises one line naming the rank that
failed first. Ranks 1..N-1 ignore SIGINT and SIGTERM: rank 0 stops them in order (the ``stop`` command),
and each gets SIGKILL if its parent dies (PR_SET_PDEATHSIG), so none outlives the learner.
"""

from __future__ import annotations

import argparse
import ctypes
import ipaddress
import logging
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import anyio
import psutil
import torch
import torch.distributed as dist

from t1async.learner.distributed import DistributedTrainer, RankFailedError, collective
from t1async.learner.trainer_config import TrainerConfig
from t1async.log import get_logger
from t1async.model.moe import MoETransformer
from t1async.procs import popen
from t1async.protocol.errors import ConfigError
from t1async.sampler.weightpush import local_address
from t1async.signals import set_handlers
from t1async.transport.natsd import free_port

log = get_logger("t1async.learner.ranks")

PEER_FAILED = 3  # a rank's exit code when another rank failed first (so the launcher names the first)
RESTART_HINT = "the learner stops (restart it: it resumes from its last checkpoint)"


@dataclass(frozen=True)
class RanksConfig:
    nproc: int
    threads: int = 1  # torch CPU threads per rank
    host: str = "127.0.0.1"  # where rank 0 hosts the group's store
    join_timeout_s: float = 300.0  # every rank must join within this
    # a collective may wait this long: ranks 1..N-1 wait in one for rank 0's next command, however long the
    # stream takes to fill a batch; a rank that dies closes its sockets, which fails the others at once
    group_timeout_s: float = 7 * 24 * 3600.0
    stop_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {self.nproc}")


def in_torchrun() -> bool:
    """Is this process a rank started by torchrun (torch.distributed's elastic launcher)?"""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: this process gets ``sig`` when its parent dies (a rank never outlives its launcher)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before the prctl
        os.kill(os.getpid(), sig)


def take_device(backend: str) -> torch.device | None:
    """NCCL: this rank's GPU (LOCAL_RANK, torchrun's index on this host), made current before any collective,
    so no two ranks of a host meet on cuda:0. None for gloo."""
    if backend != "nccl":
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    n = torch.cuda.device_count()
    if local >= n:
        raise ConfigError(f"LOCAL_RANK {local} but this host has {n} GPU(s): start at most {n} ranks per host")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def gloo_interface(peer: str) -> str | None:
    """The network interface holding this host's address on the route to ``peer`` (rank 0's store host), or
    None when that address is loopback or on no interface. gloo's default is the address the hostname resolves
    to, often 127.0.x.1: other hosts cannot reach it, so ranks on two hosts never connect."""
    addr = local_address(peer)
    if addr is None or ipaddress.ip_address(addr).is_loopback:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    return None


def join(*, backend: str = "gloo", timeout_s: float = RanksConfig.group_timeout_s) -> tuple[int, int]:
    """Join the learner's process group from torchrun's environment; returns (rank, world size). With NCCL the
    rank's GPU is set first and bound to the group (``device_id``). With gloo and no ``$GLOO_SOCKET_IFNAME``,
    the rank's sockets go on the interface that reaches rank 0's store (``MASTER_ADDR``): its own address on
    that network, on every host (design §10 "Several hosts")."""
    device = take_device(backend)
    if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):
        ifname = gloo_interface(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        if ifname is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname  # torch reads it when it makes the group's gloo device
            log.info("learner.gloo_interface", interface=ifname, master=os.environ.get("MASTER_ADDR"))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), device_id=device)
    return dist.get_rank(), dist.get_world_size()


def make_trainer(model_dir: str | Path, config: TrainerConfig) -> DistributedTrainer:
    """Rank 0: send the model dir and the trainer config to ranks 1..N-1 (waiting in ``follow``), then build
    the sharded model with them, each rank reading its own shards (``build_sharded``). Returns rank 0's
    DistributedTrainer."""
    device = "cuda" if config.device == "cuda" else "cpu"
    collective("sending the model to the ranks", dist.broadcast_object_list, [(config, str(model_dir), device)])
    trainer = DistributedTrainer.from_dir(model_dir, config, device)
    collective("waiting for the ranks to load", dist.barrier)  # each logged learner.rank_ready before it
    log.info("learner.ranks_joined", nproc=dist.get_world_size(), backend=dist.get_backend(), pid=os.getpid())
    return trainer


def follow() -> NoReturn:
    """Ranks 1..N-1 (after ``join``): get the model from rank 0, run its commands until it says stop, leave
    the group, then end the process (``leave``): 0, or ``PEER_FAILED`` when another rank failed first."""
    rank = dist.get_rank()
    code = 0
    try:
        box: list[Any] = [None]
        collective("getting the model from rank 0", dist.broadcast_object_list, box, src=0)
        tcfg, model_dir, device = box[0]
        trainer = DistributedTrainer.from_dir(model_dir, tcfg, device)  # its GPU was set in join, before any collective
        log.info("learner.rank_ready", rank=rank, world=dist.get_world_size(), pid=os.getpid())
        collective("telling rank 0 this rank loaded", dist.barrier)
        trainer.serve_rank()
    except RankFailedError as exc:
        log.error("learner.rank_failed", rank=rank, error=str(exc))
        code = PEER_FAILED
    finally:
        dist.destroy_process_group()
    log.info("learner.rank_left", rank=rank, code=code)
    leave(code)


def leave(code: int) -> NoReturn:
    """End a rank 1..N-1's process with ``code`` now, without the interpreter's teardown. Its work is done and
    on disk (a checkpoint's shards are written before rank 0 says stop) and it has left the group; what the
    teardown would still run is the destructors of torch's C++ objects that outlive ``destroy_process_group``
    (the group itself, which FSDP's device mesh holds, and its threads). In one CI run a rank 1 aborted there,
    after its last log line ("terminate called without an active exception", SIGABRT), and host 0's
    torchrun then did not exit within the test's 240 s (torch elastic's exit barrier waits up to 300 s for
    the other hosts' agents, and a failed host's never comes)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def follower_setup(threads: int) -> None:
    """What a rank 1..N-1 sets first: no SIGINT/SIGTERM (rank 0 stops it), SIGKILL with its parent, its
    threads, and freed memory returned to the kernel."""
    from t1async.learner import malloc

    set_handlers({signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_IGN})
    die_with_parent(signal.SIGKILL)
    torch.set_num_threads(max(1, threads))
    malloc.bound_malloc()


def launch(argv: list[str], config: RanksConfig) -> int:
    """``learner serve ARGV`` on ``config.nproc`` ranks under torch.distributed's elastic launcher (torchrun's
    engine). Returns 0 when every rank finished or a signal stopped them in order; raises RankFailedError
    (one line: the rank, its exit code) when one failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # the failure is our one line
    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.nproc,
        run_id=f"t1-learner-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{config.host}:{free_port(config.host)}",
        rdzv_timeout=int(config.join_timeout_s),
        max_restarts=0,
        monitor_interval=0.5,
        shutdown_timeout=int(config.stop_timeout_s),
    )
    log.info("learner.ranks_starting", nproc=config.nproc, launcher_pid=os.getpid())
    try:
        elastic_launch(lc, entrypoint=sys.executable)("-m", "t1async.learner", "serve", *argv)
    except ChildFailedError as exc:
        failures = sorted(exc.failures.items(), key=lambda kv: (kv[1].exitcode == PEER_FAILED, kv[0]))
        rank, f = failures[0]
        raise RankFailedError(
            f"learner rank {rank} (pid {f.pid}) exited with code {f.exitcode}; {RESTART_HINT}"
        ) from None
    except SignalException as exc:
        log.info("learner.ranks_signalled", signal=exc.sigval.name)
    return 0


# ------------------------------------------------------------------------------------- tests and benches


def init_group(rank: int, world: int, host: str, port: int, *, backend: str, timeout_s: float) -> None:
    """Join as ``rank`` of ``world``: rank 0 hosts the store on ``host:port``, keyed as env:// keys it (torchrun).
    The store waits for every rank first, so ranks that never come fail here, before the group exists."""
    timeout = timedelta(seconds=timeout_s)
    device = take_device(backend)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore("default_pg", store)  # what init_process_group adds to an env:// store
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout, device_id=device)


class Ranks:
    """This process as rank 0 and ranks 1..N-1 as ``python -m t1async.learner.ranks`` children (tests,
    benches): the ranks torchrun would start, with rank 0 in reach of the caller."""

    def __init__(self, config: RanksConfig) -> None:
        self.config = config
        self.procs: list[subprocess.Popen] = []
        self.exit_codes: list[int] = []  # ranks 1..N-1's, once ``close`` has stopped them
        self.joined = False
        self._tmp: tempfile.TemporaryDirectory | None = None

    def start(self, source: MoETransformer | str | Path, config: TrainerConfig) -> DistributedTrainer:
        """Start ranks 1..N-1, join the group as rank 0 and build the sharded model from ``source`` (a model dir
        every rank reads its shards of; or a model, written to a temp dir first: tests). Returns rank 0's
        DistributedTrainer."""
        c = self.config
        if isinstance(source, MoETransformer):
            from t1async.model.weights import save_pretrained

            self._tmp = tempfile.TemporaryDirectory(prefix="t1-ranks-")
            source = save_pretrained(source, Path(self._tmp.name) / "model")
        backend = "nccl" if config.device == "cuda" else "gloo"
        port = free_port(c.host)
        env = {**os.environ, "MASTER_ADDR": c.host, "MASTER_PORT": str(port), "WORLD_SIZE": str(c.nproc)}
        for rank in range(1, c.nproc):
            argv = [sys.executable, "-m", "t1async.learner.ranks", "--backend", backend, "--threads", str(c.threads)]
            e = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            self.procs.append(popen(argv, env=e, pdeathsig=signal.SIGTERM))
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
        return make_trainer(source, config)

    async def watch(self) -> None:
        """Return never; raise RankFailedError as soon as a rank has exited."""
        while True:
            for i, p in enumerate(self.procs):
                if p.poll() is not None:
                    raise RankFailedError(
                        f"learner rank {i + 1} (pid {p.pid}) exited with code {p.returncode}; {RESTART_HINT}"
                    )
            await anyio.sleep(0.5)

    def close(self, trainer: Any) -> None:
        """Stop every rank this started: the stop command when all are alive, then SIGKILL by PID to any
        still running after ``stop_timeout_s``. Safe to call twice."""
        if self.joined and isinstance(trainer, DistributedTrainer) and all(p.poll() is None for p in self.procs):
            try:
                trainer.stop_ranks()
            except RankFailedError as exc:
                log.warning("learner.ranks_stop_failed", error=str(exc))
        for p in self.procs:
            try:
                p.wait(self.config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.joined:
            dist.destroy_process_group()
            self.joined = False
        if self.procs:
            self.exit_codes = [p.returncode for p in self.procs]
            log.info("learner.ranks_stopped", codes=self.exit_codes)
        self.procs = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def rank_main(argv: list[str] | None = None) -> NoReturn:
    """A rank 1..N-1 from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); ends the
    process (``follow``)."""
    p = argparse.ArgumentParser(prog="python -m t1async.learner.ranks", description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=RanksConfig.group_timeout_s)
    args = p.parse_args(argv)
    from t1async.log import configure

    configure()
    follower_setup(args.threads)
    join(backend=args.backend, timeout_s=args.timeout)
    follow()


if __name__ == "__main__":
    rank_main()
