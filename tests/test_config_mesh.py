"""Config schema, batch arithmetic and grid validation: bad input gets an error naming the numbers.

Also the ring wire-byte formulas (docs/design.md#collectives-on-a-ring) at known values, `CommLog`
totals, and MoE keys from the command line and a TOML table. Pure Python: no process is started."""

from __future__ import annotations

import pytest

from fivefold.config import ConfigError, load_config, resolve_batch
from fivefold.distributed.comm import CommLog, ring_wire_bytes
from fivefold.distributed.mesh import ParallelDims


def test_parallel_dims_product_must_equal_world():
    assert ParallelDims().resolve(6).dp == 6
    assert ParallelDims(tp=2, pp=3).resolve(12).dp == 2
    with pytest.raises(ValueError, match=r"pp\(2\) × dp\(2\) × cp\(1\) × tp\(2\) = 8 but the world size is 6"):
        ParallelDims(pp=2, dp=2, tp=2).resolve(6)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by pp\(1\) × cp\(1\) × tp\(4\) = 4"):
        ParallelDims(tp=4).resolve(6)
    with pytest.raises(ValueError, match="parallel.tp=0"):
        ParallelDims(tp=0).resolve(2)


def test_batch_any_two_determine_the_third():
    assert resolve_batch(None, 4, 2, 3) == (24, 4, 2)
    assert resolve_batch(24, None, 2, 3) == (24, 4, 2)
    assert resolve_batch(24, 4, None, 3) == (24, 4, 2)
    assert resolve_batch(24, 4, 2, 3) == (24, 4, 2)
    assert resolve_batch(None, None, None, 2) == (16, 8, 1)
    with pytest.raises(ConfigError, match=r"global_batch=30 is not divisible by grad_accum\(4\) × dp\(2\) = 8"):
        resolve_batch(30, None, 4, 2)
    with pytest.raises(ConfigError, match=r"global_batch=30 is not divisible by micro_batch\(4\) × dp\(2\) = 8"):
        resolve_batch(30, 4, None, 2)
    with pytest.raises(ConfigError, match=r"global_batch=32 but micro_batch\(8\) × grad_accum\(2\) × dp\(3\) = 48"):
        resolve_batch(32, 8, 2, 3)
    with pytest.raises(ConfigError, match="must be positive"):
        resolve_batch(None, 0, 1, 2)


def test_config_toml_overrides_and_unknown_keys(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny"\n[train]\nsteps = 7\nlr = 0.01\n[parallel]\ndp = 2\n')
    cfg = load_config(path, ["--train.steps", "9", "--nproc=3", "--data.path", "none",
                                "--model.tie_embeddings", "true"])
    assert (cfg.model.preset, cfg.train.steps, cfg.train.lr, cfg.parallel.dp) == ("tiny", 9, 0.01, 2)
    assert (cfg.run.nproc, cfg.data.path, cfg.model.tie_embeddings) == (3, None, True)
    with pytest.raises(ConfigError, match=r"unknown key 'train.stepz'; valid keys in \[train\]: steps, "):
        load_config(None, ["--train.stepz", "1"])
    with pytest.raises(ConfigError, match="unknown config section 'foo'; valid sections: model, parallel"):
        load_config(None, ["--foo.bar", "1"])
    with pytest.raises(ConfigError, match="train.steps='x' is not a valid int"):
        load_config(None, ["--train.steps", "x"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nwarmup = 3\n")
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_config(bad)


def test_ring_wire_formulas():
    assert ring_wire_bytes("all_reduce", 100, 4) == pytest.approx(150.0)
    assert ring_wire_bytes("reduce_scatter", 100, 4) == pytest.approx(75.0)
    assert ring_wire_bytes("all_gather", 100, 4) == pytest.approx(75.0)
    assert ring_wire_bytes("all_reduce", 100, 1) == 0.0
    assert ring_wire_bytes("send", 100, 2) == 100.0


def test_comm_log_disabled_records_nothing():
    import torch

    log = CommLog(enabled=False)
    assert log.records == []
    log = CommLog()
    log.record("all_reduce", "dp", torch.zeros(10), 2, "b0")
    log.record("all_gather", "tp", torch.zeros(6, dtype=torch.bfloat16), 3)
    assert log.totals(dim="dp").payload_bytes == 40 and log.totals(dim="dp").wire_bytes == pytest.approx(40.0)
    assert log.summary()[("all_gather", "tp")].payload_bytes == 12
    log.reset()
    assert log.totals().calls == 0


def test_moe_keys_from_the_command_line_and_a_toml_table(tmp_path):
    cfg = load_config(None, ["--model.moe.experts", "8", "--model.moe.top_k", "1", "--parallel.ep", "2"])
    assert (cfg.moe.experts, cfg.moe.top_k, cfg.parallel.ep) == (8, 1, 2)
    toml = tmp_path / "moe.toml"
    toml.write_text("[model]\npreset = \"tiny\"\n[model.moe]\nexperts = 4\ncapacity_factor = 1.25\n")
    cfg = load_config(toml)
    assert (cfg.model.preset, cfg.moe.experts, cfg.moe.capacity_factor) == ("tiny", 4, 1.25)
