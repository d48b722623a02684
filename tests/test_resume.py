"""`fivefold train --resume RUN` alone: the run's stored config is the base and the command line is laid
over it (fivefold/train/resume.py), so a stopped run continues bitwise with no other flag, a layout given
now reshards, and a model flag that changes the model is one line naming the field, before spawning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fivefold.config import Config, load_config
from fivefold.train.resume import settle_batch

ARGS = ["--preset", "tiny", "--model.dim", "64", "--steps", "4", "--nproc", "2", "--run.progress", "false",
        "--run.plot", "false", "--train.eval_every", "0", "--train.global_batch", "8", "--train.seq_len", "64"]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]


def _params(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    return {k: v for k, v in torch.load(out).items() if k.startswith(("model.", "optim."))}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    from fivefold import cli

    tmp = tmp_path_factory.mktemp("resume")
    at = ["--run.out_dir", str(tmp)]
    assert cli.main(["train", *ARGS, *at, "--run.name", "full"]) == cli.EXIT_DONE
    assert cli.main(["train", *ARGS, *at, "--run.name", "stopped", "--run.exit_after", "2"]) == cli.EXIT_STOPPED
    shutil.copytree(tmp / "stopped", tmp / "resharded")
    # nothing but the run: its preset, dim, steps, batch and directory from the checkpoint
    assert cli.main(["train", "--resume", str(tmp / "stopped")]) == cli.EXIT_DONE
    assert cli.main(["train", "--resume", str(tmp / "resharded" / "checkpoints" / "step-00000002"),
                     "--run.name", "resharded", "--parallel.tp", "2"]) == cli.EXIT_DONE
    return tmp


@pytest.mark.multiprocess
def test_resume_run_alone_finishes_it_bitwise_like_an_uninterrupted_run(resumed):
    full, stopped = resumed / "full", resumed / "stopped"
    assert _losses(stopped) == _losses(full) and len(_losses(full)) == 4
    # at_end: both runs saved after their last step without checkpoint.interval
    a, b = _params(full / "checkpoints" / "step-00000004"), _params(stopped / "checkpoints" / "step-00000004")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((stopped / "checkpoints" / "step-00000004" / "fivefold.json").read_text())
    assert meta["reason"] == "end" and meta["model"]["dim"] == 64 and meta["config"]["run"]["exit_after"] == 0


@pytest.mark.multiprocess
def test_resume_run_with_another_layout_reshards_and_continues(resumed):
    full, resharded = resumed / "full", resumed / "resharded"
    meta = json.loads((resharded / "checkpoints" / "step-00000004" / "fivefold.json").read_text())
    assert meta["layout"]["tp"] == 2 and meta["layout"]["dp"] == 1 and meta["config"]["train"]["global_batch"] == 8
    want, got = dict(_losses(full)), dict(_losses(resharded))
    assert want.keys() == got.keys() and all(got[s] == want[s] for s in (1, 2))  # the steps before the stop
    # tp 2 sums in another order than dp 2: fp32 rounding over two AdamW steps (measured: max |Δ| 2.3e-7 of
    # the parameters and moments, the losses equal); bounds 1e-6 absolute, 1e-6 relative for the losses
    for s in (3, 4):
        assert abs(got[s] - want[s]) <= 1e-6 * abs(want[s]), (s, got[s], want[s])
    a, b = _params(full / "checkpoints" / "step-00000004"), _params(resharded / "checkpoints" / "step-00000004")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.multiprocess
def test_resume_run_with_another_model_is_one_line_naming_the_field(resumed, capsys):
    from fivefold import cli

    before = sorted(p.name for p in (resumed / "stopped").rglob("*"))
    code = cli.main(["train", "--resume", str(resumed / "stopped" / "checkpoints"), "--model.dim", "128",
                     "--steps", "6"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_CONFIG and len(err) == 1, err
    assert "is of another model: dim=64 there, dim=128 here" in err[0], err
    assert sorted(p.name for p in (resumed / "stopped").rglob("*")) == before  # refused before anything ran


def test_the_stored_config_is_the_base_and_only_the_given_keys_change():
    stored = load_config(None, ["--model.dim", "64", "--steps", "4", "--train.lr", "1e-3", "--run.name", "x"]).to_dict()
    stored["train"].update(global_batch=16, micro_batch=8, grad_accum=1)  # as a dp 2 run stores them
    stored["run"]["not_a_key"] = 1  # another version's key: passed over
    cfg = load_config(None, ["--steps", "8", "--parallel.tp", "2"], base=stored)
    assert (cfg.model.dim, cfg.train.steps, cfg.train.lr, cfg.run.name, cfg.parallel.tp) == (64, 8, 1e-3, "x", 2)
    settle_batch(cfg, stored)  # under another layout: the global batch and micro-batch kept, accumulation derived
    assert (cfg.train.global_batch, cfg.train.micro_batch, cfg.train.grad_accum) == (16, 8, None)
    cfg = load_config(None, ["--train.grad_accum", "4"], base=stored)
    settle_batch(cfg, stored)  # given accumulation: the micro-batch derived from the global batch
    assert (cfg.train.global_batch, cfg.train.micro_batch, cfg.train.grad_accum) == (16, None, 4)
    cfg = load_config(None, ["--train.micro_batch", "2", "--train.grad_accum", "2"], base=stored)
    settle_batch(cfg, stored)  # two given: the third derived
    assert (cfg.train.global_batch, cfg.train.micro_batch, cfg.train.grad_accum) == (None, 2, 2)
    assert Config().checkpoint.at_end and Config().checkpoint.every_minutes > 0  # the defaults save


def test_a_resume_takes_nothing_of_one_invocation_from_the_stored_config(tmp_path):
    from fivefold.checkpoint.manager import CHECKPOINT_META
    from fivefold.train.resume import resume_base, resumed_config

    ckpt = tmp_path / "runs" / "x" / "checkpoints" / "step-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    stored = load_config(None, ["--run.name", "x", "--run.out_dir", str(tmp_path / "runs"), "--run.exit_after",
                                "2", "--steps", "4", "--trust-checkpoint"]).to_dict()
    (ckpt / CHECKPOINT_META).write_text(json.dumps({"steps_done": 2, "config": stored}))
    base = resume_base(load_config(None, ["--resume", str(tmp_path / "runs" / "x")]))
    assert "exit_after" not in base["run"] and "trust" not in base["checkpoint"]
    cfg = resumed_config(None, ["--resume", str(tmp_path / "runs" / "x")])
    assert (cfg.run.name, cfg.run.exit_after, cfg.checkpoint.trust, cfg.train.steps) == ("x", 0, False, 4)
    assert cfg.run.resume == str(tmp_path / "runs" / "x")
    with pytest.raises(ValueError, match="run.resume=.*does not exist"):
        resumed_config(None, ["--resume", str(tmp_path / "nowhere")])
