"""What a trainer sees of the other replica groups (docs/design.md#replica-fault-tolerance):
`NoReplicas` when ``ft.replica_groups`` is 1, else `TorchftReplicas`, one torchft `Manager` per
rank.

Under ft every replica group is its own job (dp_shard × cp × tp × pp, no HSDP inside). Its dense
engine is built as HSDP's with R replicas: gradients are pre-divided by N_s·R and each bucket's
reduced shard is then summed across the groups — not over a torch process group but through the
Manager's reconfigurable one (`ReplicaAllReduceComm`, the ``dp_replicate`` dimension). Each step
starts with a quorum (`start_step`): a group that died is dropped, one that came back first receives
the live weights and optimizer state from a healthy group (torchft's checkpoint transport, loaded
weights-only) and then trains in step with them. With P < R live groups the summed shard is scaled
by R/P, so the gradient (and the logged loss) is the mean over the live groups' rows: the step's
global batch shrinks to P/R of its rows; the rows of the dead groups are not trained on again. The
optimizer steps only if every live rank agrees (`commit`); a failed commit repeats the step's index
with the next quorum, so every committed step index is trained once.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import ipaddress
import logging
import os
import socket
import time
import urllib.parse
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fivefold.config import Config, ConfigError
from fivefold.distributed.comm import CommLog

if TYPE_CHECKING:
    from fivefold.data_parallel import ZeroDataParallel

__all__ = [
    "NoReplicas",
    "ReplicaAllReduceComm",
    "ReplicaGroupMesh",
    "TorchftReplicas",
    "check_torchft",
    "replicas_for",
]

INSTALL = "pip install 'fivefold[ft]' (torchft)"


def check_torchft() -> None:
    """torchft importable, else one line naming the install."""
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"ft.replica_groups > 1 needs torchft, which is not installed: {INSTALL}")


def quiet_torchft() -> None:
    """torchft's Rust side logs every quorum at INFO; warnings only unless RUST_LOG says more."""
    os.environ.setdefault("RUST_LOG", "warn")
    manager_log = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _OneLine) for f in manager_log.filters):
        manager_log.addFilter(_OneLine())


class QuorumLost(RuntimeError):
    """No quorum within ``ft.timeout_s``: the lighthouse is gone or too few groups are alive. The
    group's own state is whole (every committed step), so a checkpoint of it is saved first."""

    state_intact = True  # CheckpointSaver.on_run_abort saves the steps done before it is raised


class HealFailed(RuntimeError):
    """The state a live group sent does not fit this group (another layout): the group stops."""


class _OneLine(logging.Filter):
    """torchft's manager log, one line a record: its warning at every reconfiguration that a gloo
    group has no NCCL flight recorder to reset is dropped, a peer's failure keeps its message
    without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "flight recorder" in record.getMessage():
            return False
        if record.exc_info:
            record.msg, record.args = record.getMessage().splitlines()[0], None
            record.exc_info = record.exc_text = None
        return True


class NoReplicas:
    """One replica group (ft off): every step is committed, the loss and the data are the mesh's."""

    live = None  # no quorum to report

    def wrap_mesh(self, mesh: Any) -> Any:
        return mesh

    def attach(self, engines: Iterable[ZeroDataParallel]) -> None:
        pass

    def data_share(self, dp: int, dp_rank: int, global_batch: int) -> tuple[int, int, int]:
        """(dp size, dp rank, global batch) the training rows are split by."""
        return dp, dp_rank, global_batch

    def set_start(self, step: int) -> None:
        pass

    def start_step(self, step: int) -> int:
        return step

    def commit(self) -> bool:
        return True

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def close(self) -> None:
        pass


class _Rescaled:
    """A replica all-reduce's work: waited, the sum over P live groups is scaled by R/P (gradients
    were pre-divided by R)."""

    def __init__(self, work: Any, tensor: torch.Tensor, scale: float | None) -> None:
        self.work, self.tensor, self.scale = work, tensor, scale

    def wait(self) -> bool:
        self.work.wait()
        if self.scale is not None:
            self.tensor.mul_(self.scale)
            self.scale = None
        return True


class ReplicaAllReduceComm:
    """The ``dp_replicate`` dimension through a torchft Manager: what HSDP's `ReplicaReduce` calls
    (``all_reduce``), logged in the step's `CommLog` like any collective. ``size`` is R (the divisor
    the engine pre-divides by), whatever the quorum."""

    dim = "dp_replicate"

    def __init__(self, manager: Any, groups: int, group: int, device: torch.device, log: CommLog):
        self.manager, self.size, self.rank, self.device, self.log = (
            manager,
            groups,
            group,
            device,
            log,
        )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp = dist.ReduceOp.SUM,
        async_op: bool = False,
        tag: str = "",
    ) -> _Rescaled:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"the replica all-reduce sums; {op} asked")
        if self.log.enabled:
            timing = self.log.record("all_reduce", self.dim, tensor, self.size, tag)
            if timing is not None:
                timing.blocked(timing.start, self.log.clock.mark(), True)
        from torchft.process_group import ReduceOp

        live = self.manager.num_participants()
        work = self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)
        done = _Rescaled(work, tensor, self.size / live if 0 < live < self.size else None)
        if not async_op:
            done.wait()
        return done

    def broadcast(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Nothing: every group materialises the same seeded values (or loads its own checkpoint of
        the same step), and a group that joins late receives the live state by healing."""


class ReplicaGroupMesh:
    """A replica group's mesh as its engines see it: HSDP with R replicas over the group's own
    dp × cp shards, ``dp_replicate`` the Manager's; every other dimension the group's own."""

    def __init__(self, mesh: Any, replicate: ReplicaAllReduceComm) -> None:
        self._mesh, self._replicate = mesh, replicate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mesh, name)

    def size(self, dim: str) -> int:
        return self._replicate.size if dim == "dp_replicate" else self._mesh.size(dim)

    def rank(self, dim: str) -> int:
        return self._replicate.rank if dim == "dp_replicate" else self._mesh.rank(dim)

    def comm(self, dim: str) -> Any:
        return self._replicate if dim == "dp_replicate" else self._mesh.comm(dim)


def loopback_host(lighthouse: str) -> str | None:
    """127.0.0.1 when the lighthouse is reached on loopback (the local launcher's job: every group
    on this machine), else None: a group on other machines must be reachable on the network."""
    host = urllib.parse.urlsplit(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
    try:
        return "127.0.0.1" if ipaddress.ip_address(host.hostname or "").is_loopback else None
    except ValueError:
        return "127.0.0.1" if host.hostname == "localhost" else None


@contextlib.contextmanager
def _servers_bound_to(host: str | None) -> Iterator[None]:
    """While a Manager is built, its gRPC server and its checkpoint server listen on `host` (torchft
    binds every interface: ``[::]`` and ``""``), so a local job exposes nothing beyond loopback;
    with `host` None, where torchft has them. The checkpoint server logs no request line."""
    import http.server

    import torchft.checkpointing.http_transport as http_transport
    import torchft.manager as manager

    server, http_server = manager.ManagerServer, http_transport._IPv6HTTPServer

    def manager_server(**kw: Any) -> Any:
        return server(**{**kw, "bind": f"{host}:{kw['bind'].rsplit(':', 1)[1]}"})

    base = http_server if host is None else http.server.ThreadingHTTPServer

    class QuietHTTPServer(base):  # type: ignore[misc, valid-type]
        def __init__(self, address: tuple[str, int], handler: Any) -> None:
            quiet = type("QuietHandler", (handler,), {"log_message": lambda *a: None})
            super().__init__(address if host is None else (host, address[1]), quiet)

    if host is not None:
        manager.ManagerServer = manager_server
    http_transport._IPv6HTTPServer = QuietHTTPServer
    try:
        yield
    finally:
        manager.ManagerServer, http_transport._IPv6HTTPServer = server, http_server


def _weights_only_transport(timeout: datetime.timedelta, host: str | None = None) -> Any:
    """torchft's HTTP checkpoint transport, its loads weights-only: what a peer sends is tensors,
    numbers and dicts, and loading it can run no code (torchft's own loads full pickles). Its
    address names `host` when given (a loopback-bound server), else this machine's name."""
    from torchft.checkpointing import _serialization
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: datetime.timedelta) -> object:
            import urllib.request

            with (
                urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f,
                warnings.catch_warnings(),
            ):  # torch warns that the tensors it reads share a read-only buffer: they are copied
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                return _serialization._streaming_load(f, weights_only=True)

        def address(self) -> str:
            if host is None:
                return super().address()
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    with _servers_bound_to(host):
        return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


class TorchftReplicas(NoReplicas):
    """This rank's torchft `Manager` (group rank 0's also serves the group to the lighthouse) and
    the replica state a healing peer receives: every engine's fp32 master segments and their
    optimizer state. Quorums are synchronous (a rejoining group heals before its step starts)."""

    JOIN_POLL_S = 0.05

    def __init__(self, cfg: Config, device: torch.device, log: CommLog) -> None:
        quiet_torchft()
        import torchft

        f = cfg.ft
        self.groups, self.group = f.replica_groups, f.group
        self.engines: list[ZeroDataParallel] = []
        self.live: int | None = None
        timeout = datetime.timedelta(seconds=f.timeout_s)
        pg = (
            torchft.ProcessGroupGloo(timeout=timeout)
            if device.type == "cpu"
            else torchft.ProcessGroupNCCL(timeout=timeout)
        )
        host = loopback_host(f.lighthouse)
        with _servers_bound_to(host):
            self.manager = torchft.Manager(
                pg=pg,
                load_state_dict=self._load,
                state_dict=self._state,
                min_replica_size=f.min_replicas,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                rank=dist.get_rank(),
                world_size=dist.get_world_size(),
                lighthouse_addr=f.lighthouse,
                replica_id=f"fivefold_replica_{f.group}",
                heartbeat_interval=datetime.timedelta(milliseconds=100),
                checkpoint_transport=_weights_only_transport(timeout, host),
                init_sync=False,  # the groups start from the same seeded values
                hostname=host or socket.gethostname(),
            )
        self.comm = ReplicaAllReduceComm(self.manager, self.groups, self.group, device, log)
        self._join_attempts = int(f.join_timeout_s / self.JOIN_POLL_S)
        self.ft = f

    def wrap_mesh(self, mesh: Any) -> ReplicaGroupMesh:
        return ReplicaGroupMesh(mesh, self.comm)

    def attach(self, engines: Iterable[ZeroDataParallel]) -> None:
        """The engines whose state a healing peer receives."""
        self.engines = list(engines)

    def data_share(self, dp: int, dp_rank: int, global_batch: int) -> tuple[int, int, int]:
        """Group g's ranks read rows g·dp + rank of the R·dp-way split of R × the group's batch."""
        return self.groups * dp, self.group * dp + dp_rank, self.groups * global_batch

    def set_start(self, step: int) -> None:
        """A resumed group's step (its checkpoint's), the Manager's step count."""
        self.manager.load_state_dict({"step": step, "batches_committed": step})

    def start_step(self, step: int) -> int:
        """The step's quorum (healing this group if it is behind); the step index to train now.

        A cold start (the group's first quorum, no group ahead of it) waits up to
        ``ft.join_timeout_s`` for every group: the lighthouse counts only groups already
        heartbeating, so a group still starting would miss the first steps. A group that rejoins
        a running job (healed ahead) does not wait: a group lost for good would hold it, and the
        live groups its quorums pair with, for that long. The attempts are counted, not timed, so
        the group's ranks agree on the last one."""
        join = datetime.timedelta(seconds=self.ft.join_timeout_s)
        self._quorum(step, join if self._join_attempts else None)
        if self.manager.current_step() > step:  # healed: the job is running
            self._join_attempts = 0
        for _ in range(self._join_attempts):
            if self.manager.num_participants() >= self.groups:
                break
            time.sleep(self.JOIN_POLL_S)
            self._quorum(step, join)
        self._join_attempts = 0
        self.live = self.manager.num_participants()
        if self.live > self.groups:
            raise RuntimeError(
                f"replica group {self.group}: {self.live} groups in the quorum, more than "
                f"ft.replica_groups={self.groups}: two jobs were given the same --ft.group, or "
                "one lighthouse serves two jobs"
            )
        return self.manager.current_step()

    def _quorum(self, step: int, timeout: datetime.timedelta | None) -> None:
        try:
            self.manager.start_quorum(timeout=timeout)
        except HealFailed:
            raise
        except Exception as e:  # torchft's own: a gRPC timeout, a failed reconfiguration
            waited = timeout.total_seconds() if timeout else self.ft.timeout_s
            raise QuorumLost(
                f"replica group {self.group}: no quorum for step {step + 1} within {waited:g} s "
                f"({type(e).__name__}): the lighthouse at {self.ft.lighthouse} is down or fewer "
                f"than ft.min_replicas={self.ft.min_replicas} groups are alive; start it again and "
                "resume the groups (--resume)"
            ) from None

    def commit(self) -> bool:
        return bool(self.manager.should_commit())

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The group's mean loss averaged over the live groups."""
        from torchft.process_group import ReduceOp

        loss = loss.detach().clone()
        self.manager.allreduce(loss, reduce_op=ReduceOp.AVG).wait()
        return loss

    def _segments(self) -> Iterable[tuple[str, Any, torch.Tensor]]:
        for e, engine in enumerate(self.engines):
            for i, flat in enumerate(engine.flats):
                for j, master in enumerate(flat.master_params):
                    yield f"{e}.{i}.{j}", engine, master

    def _state(self) -> dict[str, Any]:
        return {
            key: {"master": master.detach(), **engine.optimizer.state.get(master, {})}
            for key, engine, master in self._segments()
        }

    def _load(self, state: dict[str, Any]) -> None:
        try:
            self._copy_in(state)
        except Exception as e:  # not a lost quorum: the weights may be half loaded, never saved
            raise HealFailed(
                f"replica group {self.group}: the state received from a live group does not fit "
                f"this one ({type(e).__name__}: {e}); the groups must run the same layout"
            ) from None

    def _copy_in(self, state: dict[str, Any]) -> None:
        from fivefold.data_parallel.sharded_optimizer import write_back

        with torch.no_grad():
            for key, engine, master in self._segments():
                theirs = dict(state[key])
                master.copy_(theirs.pop("master"))
                mine = engine.optimizer.state.setdefault(master, {})
                torch_optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
                # a torch optimizer keeps its step count on the CPU unless fused or capturable
                on_device = any(
                    g.get("fused") or g.get("capturable") for g in torch_optimizer.param_groups
                )
                for k, v in theirs.items():
                    if k in mine:
                        mine[k].copy_(v)
                    else:
                        where = master.device if v.dim() > 0 or on_device else "cpu"
                        mine[k] = v.to(where).clone()
        write_back(flat for engine in self.engines for flat in engine.flats)

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def replicas_for(cfg: Config, device: torch.device, log: CommLog) -> NoReplicas:
    if cfg.ft.replica_groups <= 1:
        return NoReplicas()
    return TorchftReplicas(cfg, device, log)
