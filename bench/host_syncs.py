"""Host syncs per training step, per layout, simulated (docs/gpus.md#no-host-sync-in-a-step): one
rank of each layout on torch's fake process group with the ``meta`` device standing in for CUDA,
stepped by the trainer's own `train_step` at the defaults (clipping, ``check_finite``), every call
that makes the host wait for the device counted (`fivefold.observe.host_syncs`).

    python bench/run.py syncs            # every layout: first step, unlogged step, log step

Each rank runs in a fresh process (the fake group is process-global). `tests/test_gpu_path.py`
builds its dry runs from the same pieces (`LAYOUTS`, `build_rank`, `stepping_trainer`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import sys
from typing import Any

import torch

LAYOUTS: dict[str, tuple[int, dict[str, int], dict[str, Any]]] = {  # name: (world, dims, config)
    "ddp": (2, dict(dp=2), dict(zero=0)),
    "zero3": (2, dict(dp=2), dict(zero=3)),
    "tp2-sp": (2, dict(dp=1, tp=2), dict(zero=1, tp=2, sp=True)),
    "pp2-1f1b": (2, dict(pp=2, dp=1), dict(zero=1, pp=2, schedule="1f1b")),
    "pp2-dp2-zero3-zb": (4, dict(pp=2, dp=2), dict(zero=3, pp=2, schedule="zb-h1")),
    "pp3-tp2-empty-stage": (6, dict(pp=3, dp=1, tp=2),
                            dict(zero=1, pp=3, tp=2, layers="1,0,1")),
    "dp2-cp2-zero3": (4, dict(dp=2, cp=2), dict(zero=3, cp=2)),
    "hsdp-dp4-replicate2-zero2": (4, dict(dp=4, dp_replicate=2), dict(zero=2, dp_replicate=2)),
    "dp4-zero3-zeropp": (4, dict(dp=4), dict(zero=3, qwz=True, qgz=True, hpz=2)),
    # packed documents (data.documents mask, id 5 ends a document; no loss across a boundary)
    "dp2-documents": (2, dict(dp=2), dict(zero=1, documents=5)),
    "cp2-documents": (2, dict(cp=2), dict(zero=1, cp=2, documents=5)),
    # Ulysses' all-to-alls (with documents: the spans of the gathered rows) and the hybrid's ring inside them
    "cp2-ulysses-documents": (2, dict(cp=2, cp_ulysses=2), dict(zero=1, cp=2, cp_mode="ulysses", documents=5)),
    "cp4-hybrid-zero3": (4, dict(cp=4, cp_ulysses=2), dict(zero=3, cp=4, cp_mode="hybrid")),
    # FP8 linears (their amax all-reduces over tp / cp, ZeRO-3's FP8 gathers) and Muon (whole matrices owned)
    "dp2-zero2-fp8": (2, dict(dp=2), dict(zero=2, fp8="tensorwise", param="bf16")),
    "tp2-sp-fp8-rowwise": (2, dict(dp=1, tp=2), dict(zero=1, tp=2, sp=True, fp8="rowwise", param="bf16")),
    "cp2-fp8": (2, dict(cp=2), dict(zero=1, cp=2, fp8="tensorwise", param="bf16")),
    "dp2-zero3-fp8-gather": (2, dict(dp=2), dict(zero=3, fp8="tensorwise", fp8_gather=True, param="bf16")),
    "dp2-zero1-muon": (2, dict(dp=2), dict(zero=1, optim="muon")),
    "dp2-zero3-muon": (2, dict(dp=2), dict(zero=3, optim="muon")),
}
MICRO_BATCHES, SEQ = 4, 8


def meta_as_cuda() -> None:
    """Let ``meta`` take CUDA's paths where torch or fivefold choose by device type: torch's fused
    optimizer kernels (AdamW's has a meta implementation) and ring attention's fused blocks."""
    import torch.utils._foreach_utils as foreach_utils

    devices = [*foreach_utils._get_fused_kernels_supported_devices(), "meta"]
    foreach_utils._get_fused_kernels_supported_devices = lambda: devices
    sys.modules["torch.optim.optimizer"]._get_fused_kernels_supported_devices = lambda: devices
    try:
        from fivefold.context_parallel import kernels
    except ImportError:  # (a fivefold without the fused block kernels)
        return
    kernels.FUSED["meta"] = kernels.FUSED["cuda"]


def build_rank(dims: dict[str, int], o: dict[str, Any], log_every: int = 1, device: str = "meta",
               model: Any = None, seq: int = SEQ, micro_batches: int = MICRO_BATCHES):
    """(config, mesh, parallel model) of this rank of a layout (``LAYOUTS``' mesh dims and config)
    on `device` (meta: the fake process group is initialised); by default a tiny Llama, 4
    micro-batches of 8 tokens. ``o`` may also name ``param`` / ``reduce`` precisions,
    ``compile``, ``documents`` (the end-of-document id: attention masked per document), ``fp8``,
    ``fp8_gather`` and ``optim``."""
    from fivefold.config import Config
    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models import get_config
    from fivefold.models.parallelize import parallelize

    cfg = Config()
    cfg.zero.stage, cfg.zero.bucket_mb = o["zero"], 0.01
    cfg.parallel.tp, cfg.parallel.pp = o.get("tp", 1), o.get("pp", 1)
    cfg.parallel.sp, cfg.parallel.cp = o.get("sp", False), o.get("cp", 1)
    cfg.parallel.dp_replicate = o.get("dp_replicate", 1)
    cfg.parallel.cp_mode = o.get("cp_mode", "ring")
    cfg.parallel.cp_ulysses = dims["cp_ulysses"] if cfg.parallel.cp_mode == "hybrid" else None
    cfg.zero.qwz, cfg.zero.qgz, cfg.zero.hpz = o.get("qwz", False), o.get("qgz", False), o.get("hpz", 0)
    cfg.pipeline.schedule = o.get("schedule", "1f1b")
    cfg.pipeline.layers_per_stage = o.get("layers", "")
    cfg.train.grad_accum, cfg.train.seq_len = micro_batches, seq
    cfg.train.recompute, cfg.train.compile = o.get("recompute", "none"), o.get("compile", False)
    cfg.precision.param = o.get("param", cfg.precision.param)
    cfg.precision.reduce = o.get("reduce", cfg.precision.reduce)
    cfg.run.log_every = log_every
    cfg.data.documents = "mask" if o.get("documents") is not None else "cross"
    cfg.precision.fp8, cfg.zero.fp8_gather = o.get("fp8", "off"), o.get("fp8_gather", False)
    cfg.optim.name = o.get("optim", "adamw")
    if model is None:
        # (FP8: every GEMM dimension a multiple of 16 on a tp rank, as CUDA's _scaled_mm — and its meta
        # kernel — want; the tokens of a rank's micro-batch, rows × seq, too)
        wide = o.get("fp8", "off") != "off"
        model = get_config("tiny", n_layers=2, dim=64 if wide else 32, n_heads=4, n_kv_heads=2,
                           ffn_hidden=128 if wide else 64, max_seq_len=seq, vocab_size=16)
    mesh = ParallelMesh(ParallelDims(**dims), device, CommLog())
    parts = parallelize(cfg, model, mesh, torch.device(device), o.get("documents"))
    return cfg, mesh, parts


def stepping_trainer(cfg, parts, mesh, steps: int, rows: int = 4, vocab: int = 16,
                     peak_flops: float | None = None, flops_per_token: float = 1.0):
    """The trainer's own `train_step` over `parts` (no data file, run directory or checkpoints): a
    token array in memory; the run record (rank 0 of nothing: no file), summary and heartbeat
    observers."""
    import numpy as np

    from fivefold.fault_tolerance.replicas import NoReplicas
    from fivefold.train.data import TokenDataset
    from fivefold.train.metrics import (
        RunRecord,
        RunRecordLog,
        RunSummary,
        Throughput,
        TrainingClock,
    )
    from fivefold.train.trainer import Heartbeat, Trainer

    dp = mesh.size("dp")
    t = cfg.train = dataclasses.replace(cfg.train, steps=steps, micro_batch=max(1, rows // dp))
    t.global_batch = t.micro_batch * dp * t.grad_accum
    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.model, trainer.log, trainer.device = cfg, parts, mesh.comm_log, mesh.device
    trainer.dp, trainer.dp_rank, trainer.start, trainer.model_state_mb = dp, mesh.rank("dp"), 0, 0.0
    trainer.replicas = NoReplicas()  # ft off: the data is the mesh's
    trainer.data_dp, trainer.data_rank, trainer.data_batch = trainer.replicas.data_share(
        dp, trainer.dp_rank, t.global_batch)
    tokens = np.random.default_rng(0).integers(0, vocab, 64 * t.seq_len * max(1, rows), np.int64)
    trainer.data = TokenDataset(tokens.astype(np.uint32 if vocab > 65535 else np.uint16),
                                t.seq_len, val_fraction=0.0)
    if getattr(parts, "documents_eos", None) is not None:  # the loss not taken across documents
        trainer.data.ignore_targets_after(parts.documents_eos)
    trainer.clock = TrainingClock(0)
    trainer.throughput = Throughput(t.global_batch * t.seq_len, flops_per_token, peak_flops,
                                    mesh.world.size)
    trainer.summary = RunSummary()
    record = RunRecord(None, steps, False, "syncs")
    trainer.observers = [RunRecordLog(record, parts, trainer.throughput, None), trainer.summary,
                         Heartbeat()]
    return trainer


def count_syncs(name: str, rank: int, steps: int = 4, log_every: int = 3) -> dict[str, Any]:
    """In a fresh process: host syncs of each of `steps` trainer steps of `name`'s rank `rank`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fivefold.observe.host_syncs import HostSyncs

    meta_as_cuda()
    world, dims, o = LAYOUTS[name]
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        cfg, mesh, parts = build_rank(dims, o, log_every)
        trainer = stepping_trainer(cfg, parts, mesh, steps)
        where, logged = [], []
        for step in range(steps):
            with HostSyncs(devices=("meta",)) as syncs:
                logged.append(trainer.train_step(step).logged)
            where.append(syncs.where)
        return dict(where=where, logged=logged)
    finally:
        dist.destroy_process_group()


def bench_syncs(names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Rank 0 of each layout: syncs on the first step, an unlogged step and a log step, with the
    call sites of the unlogged step's."""
    names = names or tuple(LAYOUTS)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = {n: pool.submit(count_syncs, n, 0) for n in names}
        runs = {n: f.result(timeout=600) for n, f in futures.items()}
    rows = {}
    for n, r in runs.items():
        first_unlogged = r["logged"].index(False)
        last_logged = len(r["logged"]) - 1
        rows[n] = dict(first=len(r["where"][0]), unlogged=len(r["where"][first_unlogged]),
                       logged=len(r["where"][last_logged]),
                       sites=sorted({w.splitlines()[0] for w in r["where"][first_unlogged]}))
    return {"torch": torch.__version__, "layouts": rows}


def format_syncs_table(result: dict[str, Any]) -> str:
    lines = ["| layout | first step | unlogged step | log step | what an unlogged step waits on |",
             "|---|---:|---:|---:|---|"]
    for n, r in result["layouts"].items():
        sites = ", ".join(s.rstrip(":") for s in r["sites"]) or "-"
        lines.append(f"| {n} | {r['first']} | {r['unlogged']} | {r['logged']} | {sites} |")
    return "\n".join(lines)
