"""Starting a fault-tolerant job (docs/reliability.md#keeping-training-when-a-replica-dies): the
checks ``ft`` needs before anything starts (`check_ft`), one replica group's own configuration
(`group_config`), and the local launcher's whole job on one machine (`run_groups`): a torchft
lighthouse on 127.0.0.1 and R group launchers, each restarting its own workers
(``run.max_restarts``) while the others train on."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import urllib.parse
from collections.abc import Collection
from pathlib import Path
from typing import Any

from fivefold.config import Config, ConfigError
from fivefold.fault_tolerance.replicas import check_torchft, quiet_torchft
from fivefold.run_plan import RunPlan

__all__ = [
    "check_ft",
    "check_group",
    "check_group_plan",
    "check_group_reachable",
    "group_config",
    "lighthouse_reachable",
    "run_groups",
]


def check_ft(cfg: Config, world: int) -> None:
    """One line naming what to change when ``ft`` cannot serve the whole job `cfg` on `world`
    processes (all the groups together), before any group starts."""
    f, p = cfg.ft, cfg.parallel
    groups = f.replica_groups
    check_group(cfg)
    if groups == 1:
        return
    if world % groups:
        raise ConfigError(
            f"ft.replica_groups={groups} does not divide the world of {world} processes: each "
            "group is world / replica_groups ranks; choose a divisor"
        )
    if p.dp != -1 and p.dp % groups:
        raise ConfigError(
            f"parallel.dp={p.dp} with ft.replica_groups={groups}: dp counts every group's data "
            "ranks and must be a multiple of the groups"
        )
    if cfg.train.global_batch is not None and cfg.train.global_batch % groups:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} with ft.replica_groups={groups}: each "
            "group trains an equal part; give a multiple of the groups"
        )


def check_group(cfg: Config) -> None:
    """What one replica group's own configuration (under torchrun: its world, dp and batch are
    the group's) must satisfy for ``ft``: one line naming what to change."""
    f, p, z = cfg.ft, cfg.parallel, cfg.zero
    groups = f.replica_groups
    if groups < 1:
        raise ConfigError(f"ft.replica_groups={groups}: give 1 (off) or more replica groups")
    if groups == 1:
        return
    check_torchft()
    if not 1 <= f.min_replicas <= groups:
        raise ConfigError(f"ft.min_replicas={f.min_replicas}: give 1 to {groups} (the groups)")
    for key in ("timeout_s", "heartbeat_timeout_s", "join_timeout_s"):
        if getattr(f, key) <= 0:
            raise ConfigError(f"ft.{key}={getattr(f, key):g}: give a positive number of seconds")
    refusals = (
        (
            p.dp_replicate > 1,
            f"parallel.dp_replicate={p.dp_replicate} with ft: the replica groups are ft's "
            "replicas; give parallel.dp_replicate 1",
        ),
        (
            z.stage == 0,
            "ft with zero.stage 0: ft reduces HSDP's shard across the groups; use zero.stage 1 "
            "to 3 (with one rank per group, stage 1 is DDP across the groups)",
        ),
        (
            z.qgz,
            "ft with zero.qgz: the replica reduce sums plain shards; drop zero.qgz",
        ),
        (
            z.constant_buffers,
            "ft with zero.constant_buffers: the replica all-reduce runs on the fresh bucket "
            "shards; drop zero.constant_buffers",
        ),
        (
            cfg.precision.param == "fp16",
            "ft with precision.param fp16: the loss scaler's overflow vote stays inside a group; "
            "use bf16 or fp32",
        ),
    )
    for refused, line in refusals:
        if refused:
            raise ConfigError(line)
    # a live group may wait ft.timeout_s for a stalled peer's all-reduce, then as long for the
    # quorum without it: its own watchdog must not take that for a stall (whose default is 180 s)
    stall = cfg.run.stall_timeout_s or 180.0
    if stall <= 2 * f.timeout_s:
        raise ConfigError(
            f"run.stall_timeout_s={stall:g} with ft.timeout_s={f.timeout_s:g}: a live group waits "
            "up to ft.timeout_s for a stalled peer and as long again for the quorum without it, "
            f"which its watchdog would call a stall; give run.stall_timeout_s above "
            f"{2 * f.timeout_s:g} or a smaller ft.timeout_s"
        )
    if f.lighthouse and not lighthouse_reachable(f.lighthouse):
        raise ConfigError(
            f"ft.lighthouse={f.lighthouse!r} is not reachable: start one (torchft_lighthouse "
            "--min_replicas 1 --bind [::]:29510) or leave ft.lighthouse empty for a local job"
        )


def check_group_reachable(cfg: Config, torchrun: bool) -> None:
    """One group's own job with the lighthouse on another machine: the other groups build the
    replica process group through this group's store (torchft's Manager names MASTER_ADDR), so
    that must be an address they can reach."""
    from fivefold.fault_tolerance.replicas import loopback_host

    if on_this_machine(cfg.ft.lighthouse):
        return  # the groups beside it, on this machine (one on another would be refused there)
    if not torchrun:
        raise ConfigError(
            f"ft.lighthouse={cfg.ft.lighthouse} is on another machine, but the local launcher's "
            "store listens on 127.0.0.1, which the other groups cannot reach: run each group "
            "under torchrun with --master-addr set to this machine's address"
        )
    master = os.environ.get("MASTER_ADDR", "")
    if loopback_host(f"http://{master}:0") is not None or not master:
        raise ConfigError(
            f"MASTER_ADDR={master or '(unset)'}: the other replica groups connect to this group's "
            "store; give torchrun --master-addr this machine's address (or --rdzv-endpoint "
            "host:port)"
        )


def on_this_machine(address: str) -> bool:
    """Whether the lighthouse's host (http://host:port) is an address of this machine: one it can
    bind (loopback, or an interface's)."""
    url = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        found = socket.getaddrinfo(url.hostname or "", None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in found:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def check_group_plan(cfg: Config, plan: RunPlan) -> None:
    """What only the resolved plan tells: an MoE model (its experts' engine is not reduced across
    the groups)."""
    if cfg.ft.replica_groups > 1 and plan.model.moe is not None:
        raise ConfigError(
            "ft with an MoE model: the experts' engine is not reduced across replica groups yet; "
            "use a dense model or ft.replica_groups 1"
        )


def lighthouse_reachable(address: str, timeout_s: float = 3.0) -> bool:
    """Whether something listens at the lighthouse's host:port (http://host:port)."""
    url = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    if url.hostname is None or url.port is None:
        return False
    try:
        with socket.create_connection((url.hostname, url.port), timeout=timeout_s):
            return True
    except OSError:
        return False


def group_config(cfg: Config, group: int, lighthouse: str) -> Config:
    """Replica group `group`'s own job: world / R ranks (``run.nproc``), dp / R, global batch / R,
    its run directory ``<run.out_dir>/<run.name>/replica<group>`` (own lock, records and
    checkpoints)."""
    groups = cfg.ft.replica_groups
    p, t, r, c = cfg.parallel, cfg.train, cfg.run, cfg.checkpoint
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(p, dp=p.dp if p.dp == -1 else p.dp // groups),
        train=dataclasses.replace(
            t, global_batch=None if t.global_batch is None else t.global_batch // groups
        ),
        run=dataclasses.replace(
            r,
            nproc=r.nproc // groups,
            out_dir=str(Path(r.out_dir) / r.name),
            name=f"replica{group}",
        ),
        checkpoint=dataclasses.replace(
            c, dir=str(Path(c.dir) / f"replica{group}") if c.dir else ""
        ),
        ft=dataclasses.replace(cfg.ft, group=group, lighthouse=lighthouse),
    )


def _start_lighthouse(cfg: Config) -> Any:
    from torchft._torchft import LighthouseServer

    f = cfg.ft
    return LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=f.min_replicas,
        # the first quorum waits this long for every group (then goes on with min_replicas)
        join_timeout_ms=int(f.join_timeout_s * 1000),
        heartbeat_timeout_ms=int(f.heartbeat_timeout_s * 1000),
        # how often the lighthouse looks for a complete quorum: every step waits up to one tick
        quorum_tick_ms=10,
    )


def _host_share(group: int, groups: int) -> set[int] | None:
    """Group `group`'s own slice of this host's cores (None when there are fewer cores than
    groups): the groups side by side on one host must not oversubscribe it, each sizing its
    threads to the whole host."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < groups:
        return None
    per = len(cores) // groups
    return set(cores[group * per : (group + 1) * per])


def _group_main(
    cfg: Config, given: Collection[str] | None, results: Any, cores: set[int] | None
) -> None:
    from fivefold.train.trainer import run

    if cores is not None:  # the group's workers size their threads to this share
        os.sched_setaffinity(0, cores)
    try:
        results.put((cfg.ft.group, run(cfg, given), None))
    except BaseException as e:  # the parent names it; the group's own launcher said more
        results.put((cfg.ft.group, None, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None


def run_groups(cfg: Config, given: Collection[str] | None = None) -> Any:
    """The local launcher's ft job: a lighthouse (unless ``ft.lighthouse`` names one) and R group
    launchers side by side; returns group 0's `TrainResult`. A group that fails for good (its
    restarts spent) fails the job once the others are done."""
    from fivefold.train.validate import validate

    check_ft(cfg, cfg.run.nproc)
    groups = cfg.ft.replica_groups
    for g in range(groups):  # every group's errors here, before anything starts
        c = group_config(cfg, g, cfg.ft.lighthouse)
        check_group_plan(c, validate(c, c.run.nproc))
    quiet_torchft()  # (the groups inherit it)
    lighthouse = None if cfg.ft.lighthouse else _start_lighthouse(cfg)
    # torchft names it by this machine's name; it listens on 127.0.0.1, which the groups then
    # also bind their servers to (`loopback_host`)
    address = cfg.ft.lighthouse or "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    configs = [group_config(cfg, g, address) for g in range(groups)]
    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    procs = [
        context.Process(
            target=_group_main, args=(c, given, results, _host_share(c.ft.group, groups))
        )
        for c in configs
    ]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        if lighthouse is not None:
            lighthouse.shutdown()
    outcome = {}
    while not results.empty():
        g, result, error = results.get()
        outcome[g] = (result, error)
    failed = {g: outcome.get(g, (None, "exited without a result"))[1] for g in range(groups)}
    failed = {g: e for g, e in failed.items() if e is not None}
    if failed:
        raise RuntimeError(
            "; ".join(f"replica group {g} failed: {e}" for g, e in sorted(failed.items()))
        )
    return outcome[0][0]
