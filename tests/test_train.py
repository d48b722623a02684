"""The trainer end to end (spawned gloo workers) and the model-state memory meter.

Trained runs (DDP, ZeRO-3 with accumulation, pp 2 × tp 2 zero-bubble; `multiprocess`) must learn,
write their metrics, plots and trace, and log traffic, model-state bytes (16Ψ/N under ZeRO-3), MFU
and the bubble equal to the formulas (docs/design.md#data-parallel-traffic,
docs/design.md#flops-and-mfu). In process: a bad layout refused before spawning, the lr schedule,
and 16Ψ for fp32 Adam."""

from __future__ import annotations

import json

import pytest
import torch

from fivefold.config import ConfigError, load_config
from fivefold.models import build_model, get_config
from fivefold.observe.memory import model_state_bytes
from fivefold.train.trainer import lr_at, run


@pytest.mark.multiprocess
def test_trainer_end_to_end_two_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path / "cache"))  # the workers measure the CPU's peak afresh
    cfg = load_config(None, ["--preset", "tiny", "--steps", "20", "--nproc", "2", "--run.out_dir", str(tmp_path),
                             "--run.name", "e2e", "--run.progress", "false", "--train.eval_every", "10",
                             "--train.seq_len", "64", "--train.lr", "3e-3"])
    result = run(cfg)
    assert result.final_loss < result.first_loss - 1.0, result
    assert 5.0 < result.first_loss < 6.0  # ≈ ln(256) for a fresh byte-level model
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 21))  # steps done, 1-based
    assert [r["step"] for r in records if r["kind"] == "val"] == [10, 20]
    assert records[0]["kind"] == "config" and records[0]["dp"] == 2
    # DDP traffic per step: all-reduce of every gradient element once (fp32), one call per bucket.
    psi = records[0]["params"]
    assert all(r["comm_payload_bytes"] == 4 * psi for r in train)
    assert all(r["comm_wire_bytes"] == pytest.approx(2 * (2 - 1) / 2 * 4 * psi) for r in train)
    assert (tmp_path / "e2e" / "loss.png").stat().st_size > 1000
    # MFU (docs/design.md#flops-and-mfu): the model's FLOPs at each logged step's speed over 2 × this CPU's
    # measured 1-thread peak
    tiny = records[0]["model_config"]
    flops = train[-1]["flops_per_token"]
    assert flops == 6 * (psi - tiny["vocab_size"] * tiny["dim"]) + 6 * tiny["n_layers"] * 64 * tiny["dim"]  # causal half
    for r in train:
        assert 0 < r["mfu"] < 1.5 and r["achieved_tflops_per_device"] > 0
        assert r["achieved_tflops_per_device"] == pytest.approx(r["tokens_per_s"] * flops / 2 / 1e12)
    summary = [r for r in records if r["kind"] == "summary"]
    assert summary and 0 < summary[0]["mfu"] < 1.5
    assert (tmp_path / "cache" / "cpu_peak.json").exists()


@pytest.mark.multiprocess
def test_trainer_zero3_with_accumulation(tmp_path):
    cfg = load_config(None, ["--preset", "tiny", "--steps", "10", "--zero", "3", "--run.out_dir", str(tmp_path),
                             "--run.name", "z3", "--run.progress", "false", "--train.eval_every", "10",
                             "--train.seq_len", "64", "--train.lr", "3e-3", "--train.grad_accum", "2",
                             "--train.micro_batch", "4", "--run.plot", "false"])
    result = run(cfg)
    assert result.final_loss < result.first_loss - 0.5, result
    records = [json.loads(line) for line in (tmp_path / "z3" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    # Per step with 2 micro-steps: (2 all-gathers + 1 reduce-scatter) × Ψ per micro-step, plus the
    # 4-byte clipping norm; Ψ is padded to a multiple of 2 per unit (every tiny unit is already even).
    psi = records[0]["params"]
    assert all(r["comm_payload_bytes"] == 2 * 3 * 4 * psi + 4 for r in train)
    # ZeRO-3 model state with fp32 AdamW: 16Ψ/N bytes (plus a few bytes of Adam step counters).
    assert train[-1]["model_state_mb"] * 2**20 == pytest.approx(16 * psi / 2, rel=1e-3)


def test_trainer_rejects_bad_layout_before_spawning():
    cfg = load_config(None, ["--nproc", "2", "--parallel.dp", "3"])
    with pytest.raises(ValueError, match=r"dp\(3\).*world size is 2"):
        run(cfg)
    cfg = load_config(None, ["--nproc", "2", "--train.global_batch", "30", "--train.micro_batch", "4"])
    with pytest.raises(ConfigError, match=r"global_batch=30 is not divisible by micro_batch\(4\) × dp\(2\) = 8"):
        run(cfg)
    cfg = load_config(None, ["--nproc", "2", "--parallel.pp", "2", "--train.grad_accum", "1"])
    with pytest.raises(ValueError, match=r"M=1 < P=2"):
        run(cfg)


def test_lr_schedule_warmup_then_cosine():
    cfg = load_config(None, ["--train.lr", "1.0", "--train.warmup_steps", "10", "--steps", "110",
                             "--train.min_lr_ratio", "0.1"])
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)


def test_model_state_bytes_fp32_adam_is_16_psi():
    model = build_model(get_config("tiny", tie_embeddings=True))
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    opt.step()
    m = model_state_bytes(model, opt)
    n_tensors = len(list(model.parameters()))
    assert m.params == 4 * psi and m.grads == 4 * psi
    assert m.optimizer == 8 * psi + 4 * n_tensors  # exp_avg + exp_avg_sq, plus a scalar fp32 step each


@pytest.mark.multiprocess
def test_trainer_pipeline_tensor_data_parallel(tmp_path):
    """pp 2 × dp 1 × tp 2 with ZeRO-1 and the zero-bubble schedule: trains, and writes the measured
    timeline (PNG + Chrome trace) with its bubble next to the formula."""
    cfg = load_config(None, ["--preset", "tiny", "--model.n_layers", "4", "--steps", "6", "--nproc", "4",
                             "--parallel.pp", "2", "--parallel.tp", "2", "--zero", "1", "--train.grad_accum", "4",
                             "--train.micro_batch", "2", "--pipeline.schedule", "zb-h1", "--run.out_dir",
                             str(tmp_path), "--run.name", "pp", "--run.progress", "false", "--train.eval_every", "6",
                             "--train.seq_len", "32", "--train.lr", "3e-3"])
    result = run(cfg)
    assert result.final_loss < result.first_loss - 0.3, result
    assert result.final_val_loss is not None and result.final_val_loss < 5.5
    records = [json.loads(line) for line in (tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()]
    bubble = next(r for r in records if r["kind"] == "pipeline")
    assert 0.0 <= bubble["measured_bubble"] < 1.0 and bubble["formula_bubble"] == pytest.approx(1 / 13)
    trace = json.loads((tmp_path / "pp" / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert sum(1 for e in events if e.get("ph") == "X") == 2 * 3 * 4  # 2 ranks × (F, I, W) × 4 micro-batches
    assert (tmp_path / "pp" / "timeline.png").stat().st_size > 1000
