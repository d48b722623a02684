"""GPU smoke test, for a machine with two or more accelerators (skipped elsewhere, so CI skips it).

    .venv/bin/python -m pytest -s tests/gpu

Two processes (`multiprocess`), one GPU each, NCCL: DDP, ZeRO-3, tp 2 (+SP), pp 2 (1F1B and
zero-bubble, rendezvous p2p) and cp 2 each train a few steps of a small Llama in fp32 and must equal
single-process training on one GPU (TF32 off, so they differ by reduction order only); the time per
step of each layout is printed."""

from __future__ import annotations

import time

import pytest
import torch

from fivefold.distributed.launch import launch_local, resolve_device

ACCELERATOR = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
pytestmark = [pytest.mark.skipif(ACCELERATOR is None or torch.accelerator.device_count() < 2,
                                 reason="needs two accelerators (run on a GPU machine: pytest -s tests/gpu)"),
              pytest.mark.multiprocess]  # (it spawns one worker per device)

STEPS, LR, WD, CLIP, EPS, SEQ, M = 4, 1e-2, 0.1, 0.5, 1e-4, 16, 4
LAYOUTS = {  # name: (dims, config overrides)
    "ddp": (dict(dp=2), dict(zero=0)),
    "zero3": (dict(dp=2), dict(zero=3)),
    "tp2-sp": (dict(dp=1, tp=2), dict(zero=1, tp=2, sp=True)),
    "pp2-1f1b": (dict(pp=2, dp=1), dict(zero=1, pp=2, schedule="1f1b")),
    "pp2-zb-h1": (dict(pp=2, dp=1), dict(zero=1, pp=2, schedule="zb-h1")),
    "cp2": (dict(cp=2, dp=1), dict(zero=1, cp=2)),
}


def _model():
    from fivefold.models import get_config

    return get_config("tiny", n_layers=4, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=SEQ,
                      vocab_size=64)


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (8, SEQ), generator=g), torch.randint(0, 64, (8, SEQ), generator=g)


def _config(o: dict):
    from fivefold.config import Config

    cfg = Config()
    cfg.zero.stage = o["zero"]
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sp = o.get("tp", 1), o.get("pp", 1), o.get("sp", False)
    cfg.parallel.cp = o.get("cp", 1)
    cfg.pipeline.schedule = o.get("schedule", "1f1b")
    cfg.train.lr, cfg.train.weight_decay, cfg.train.beta2, cfg.train.eps = LR, WD, 0.999, EPS
    cfg.train.grad_accum, cfg.train.seq_len, cfg.train.seed = M, SEQ, 0
    return cfg


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _worker(device_type: str) -> dict:
    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.launch import to_device
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    torch.set_float32_matmul_precision("highest")
    device = resolve_device(device_type)  # this worker's own device (LOCAL_RANK)
    out = {}
    for name, (dims, o) in LAYOUTS.items():
        mesh = ParallelMesh(ParallelDims(**dims), device, CommLog())
        dp = mesh.comm("dp")
        parts = parallelize(_config(o), _model(), mesh, device)
        history, times = [], []
        for step in range(STEPS):
            x, y = _batch(step)
            xs, ys = x.chunk(dp.size)[dp.rank], y.chunk(dp.size)[dp.rank]
            _sync(device)
            t0 = time.perf_counter()
            parts.forward_backward([(to_device(a, device), to_device(b, device))
                                    for a, b in zip(xs.chunk(M), ys.chunk(M))])
            parts.step(CLIP)
            _sync(device)
            times.append(time.perf_counter() - t0)
            history.append({k: v.detach().cpu() for k, v in parts.full_state_dict().items()})
        tp_dims = {n: pl.tp_dim for e in parts.engines.values() for n, pl in getattr(e.module, "tp_placements",
                                                                                      {}).items()}
        out[name] = dict(history=history, step_s=sorted(times[1:])[len(times[1:]) // 2], tp_rank=mesh.rank("tp"),
                         tp_dims=tp_dims)
    return out


def _reference(device_type: str) -> list[dict[str, torch.Tensor]]:
    from fivefold.models import build_model
    from fivefold.models.loss import lm_cross_entropy

    torch.set_float32_matmul_precision("highest")
    device = resolve_device(device_type)
    model = build_model(_model(), seed=0, device=device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in model.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, eps=EPS)
    history = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in _batch(step))
        opt.zero_grad()
        lm_cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        history.append({n: p.detach().cpu().clone() for n, p in model.named_parameters()})
    return history


def test_every_layout_on_two_gpus_equals_one_gpu(device_type: str | None = None):
    """(`device_type="cpu"` rehearses the same script on two gloo CPU workers.)"""
    device_type = device_type or ACCELERATOR.type
    ref = _reference(device_type)
    results = launch_local(_worker, 2, device_type, device=device_type, timeout_s=600.0)
    for name in LAYOUTS:
        print(f"{name:>10}: {results[0][name]['step_s'] * 1e3:8.1f} ms/step (median of {STEPS - 1}, rank 0)")
        for rank, res in enumerate(results):
            r = res[name]
            for step, got in enumerate(r["history"]):
                for pname, value in got.items():
                    want = ref[step][pname]
                    dim = r["tp_dims"].get(pname)
                    if dim is not None:
                        want = want.chunk(2, dim)[r["tp_rank"]]
                    where = f"{name} rank {rank} step {step} {pname}"
                    torch.testing.assert_close(value, want, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
