"""`fivefold train --layout auto` (``parallel.layout = "auto"``, fivefold/train/layout_auto.py).

Spawned once (`multiprocess`): at world 4 on the CPU the trainer searches, prints the chosen layout
and its two runners-up, trains the chosen one — the layout its checkpoint's fivefold.json and
metrics.jsonl record equals the chosen overrides, a full plan of it fits — and stores the choice as
``layout_auto``; a ``--resume`` of that run keeps the layout and the entry without a search, one
with --layout auto searches again with the keys given now held. In process (a fixed stand-in for
the CPU, no measurement): which keys the user gave and which the search holds, the batch held, the
choice against the search's own ranking, the filter of what this device refuses, and each refusal
as one line before any worker starts."""

from __future__ import annotations

import copy
import json

import pytest

from fivefold.cli import main as cli
from fivefold.config import ConfigError, describe_keys, load_config
from fivefold.plan.hardware import GB, Hardware
from fivefold.plan.layout import plan_layout
from fivefold.plan.search import search
from fivefold.run_plan import RunPlan, validate_layout
from fivefold.train import layout_auto
from fivefold.train.layout_auto import (
    apply,
    choose,
    fixed_keys,
    given_keys,
    held_batch,
    with_choice,
)

# this CPU as a plan takes it, fixed: the in-process tests measure nothing
CPU = Hardware(name="cpu-test", memory_gb=4.0, peak_tflops=0.2, intra_node_gbps=3.0,
               inter_node_gbps=3.0, gpus_per_node=4, hbm_gbps=13.0)
TINY = ["--preset", "tiny", "--nproc", "4", "--train.seq_len", "32", "--layout", "auto"]


def overrides_dict(overrides: list[str]) -> dict[str, str]:
    return dict(zip((k[2:] for k in overrides[::2]), overrides[1::2]))


@pytest.fixture(scope="module")
def tiny_choice():
    cfg = load_config(None, TINY)
    return cfg, choose(cfg, 4, CPU, given_keys(None, TINY))


def test_given_keys_from_the_toml_file_and_the_command_line(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 3\n[parallel]\ntp = 2\nlayout = "auto"\n[model.moe]\nexperts = 4\n')
    given = given_keys(toml, ["--zero", "3", "--parallel.pp=2", "--train.recompute", "full", "--resume"])
    assert given == {"train.steps", "parallel.tp", "parallel.layout", "model.moe.experts", "zero.stage",
                     "parallel.pp", "train.recompute", "run.resume"}
    assert given_keys(tmp_path / "missing.toml", []) == set()  # load_config says what is wrong with it


def test_fixed_keys_are_the_searched_ones_given():
    cfg = load_config(None, ["--parallel.tp", "2", "--pipeline.virtual", "2"])
    assert fixed_keys(cfg, {"parallel.tp", "train.steps", "parallel.dp", "pipeline.virtual"}) == {
        "parallel.tp", "pipeline.schedule"}  # dp -1 ("the rest") holds nothing
    assert fixed_keys(cfg, {"parallel.tp", "parallel.dp"}) == {"parallel.tp"}
    # a config built in code: what differs from the defaults
    coded = load_config(None, ["--parallel.tp", "2", "--zero", "3", "--train.steps", "7"])
    assert fixed_keys(coded, None) == {"parallel.tp", "zero.stage"}
    assert fixed_keys(load_config(None, ["--parallel.tp", "1"]), {"parallel.tp"}) == {"parallel.tp"}


def test_held_batch_is_the_configs_own_layouts():
    assert held_batch(load_config(None, []), 4) == ["--train.global_batch", "32", "--train.micro_batch", "8",
                                                    "--train.grad_accum", "none"]
    assert held_batch(load_config(None, ["--parallel.tp", "2"]), 4)[:2] == ["--train.global_batch", "16"]
    assert held_batch(load_config(None, ["--train.grad_accum", "2"]), 4) == [
        "--train.global_batch", "64", "--train.micro_batch", "none", "--train.grad_accum", "2"]
    assert held_batch(load_config(None, ["--train.global_batch", "64", "--train.micro_batch", "4"]), 4)[:4] == [
        "--train.global_batch", "64", "--train.micro_batch", "4"]
    # the config's own layout does not resolve on 4 ranks: each candidate resolves the batch as given
    assert held_batch(load_config(None, ["--parallel.tp", "3"]), 4) == []
    odd = load_config(None, [*TINY, "--train.global_batch", "30", "--train.micro_batch", "5"])
    assert held_batch(odd, 4) == []
    assert {p.global_batch for p in choose(odd, 4, CPU, {"train.recompute", "zero.stage"}).plans} == {30}  # dp 1 or 2


def test_the_choice_is_the_searchs_fastest_that_fits_and_the_runners_up(tiny_choice):
    cfg, choice = tiny_choice
    base = apply(copy.deepcopy(cfg), {"batch_overrides": choice.batch, "chosen": {"overrides": []}})
    ranked = search(base, 4, CPU, top=3)
    assert [p.overrides for p in choice.plans] == [p.overrides for p in ranked.plans]
    assert len(choice.plans) == 3 and choice.fixed == [] and choice.fitting == ranked.fitting
    steps = [p.time["step"] for p in choice.plans]
    assert steps == sorted(steps) and all(p.fits for p in choice.plans)
    assert {p.global_batch for p in choice.plans} == {32}  # the same step of data for each
    record = choice.record()
    assert record["chosen"]["overrides"] == choice.plans[0].overrides
    assert [r["layout"] for r in record["runners_up"]] == [p.layout for p in choice.plans[1:]]
    assert record["hardware"]["name"] == "cpu-test" and record["world"] == 4
    json.dumps(record)  # plain data: it goes into fivefold.json
    # the config it makes: a manual layout, and the full plan of it (every pipeline rank) fits with the
    # search's step time
    trained = apply(cfg, record)
    assert trained.parallel.layout == "manual" and trained.train.global_batch == 32
    full = plan_layout(trained, 4, CPU)
    assert full.dims == choice.plans[0].dims and full.fits
    assert full.time["step"] == pytest.approx(record["chosen"]["step_s"])
    table = choice.table().splitlines()
    assert table[0].startswith("fivefold train --layout auto: ") and "training #1" in table[0]
    assert [line.split()[0] for line in table[3:]] == ["1", "2", "3"]
    assert all(p.layout in line for p, line in zip(choice.plans, table[3:]))
    assert layout_auto.note(record).startswith(f"parallel.layout=auto chose {choice.plans[0].layout}: ")


def test_keys_given_stay_fixed():
    args = [*TINY, "--parallel.tp", "2", "--train.recompute", "full"]
    choice = choose(load_config(None, args), 4, CPU, given_keys(None, args))
    assert choice.fixed == ["parallel.tp", "train.recompute"]
    assert all(p.dims.tp == 2 and "recompute full" in p.layout for p in choice.plans)
    assert "kept as given: parallel.tp, train.recompute" in choice.table()


def test_what_this_device_refuses_is_passed_over(monkeypatch, tiny_choice):
    cfg, _ = tiny_choice

    def refuse_zero3(trial, world, device_type=None):
        if trial.zero.stage == 3:
            raise ConfigError("ZeRO-3 refused here")
        return validate_layout(trial, world, device_type)

    monkeypatch.setattr(layout_auto, "validate_layout", refuse_zero3)
    choice = choose(cfg, 4, CPU, {"train.recompute"})  # (recompute held: fewer candidates)
    assert len(choice.plans) == 3 and all("ZeRO-3" not in p.layout for p in choice.plans)

    def refuse(trial, world, device_type=None):
        raise ConfigError("refused here")

    monkeypatch.setattr(layout_auto, "validate_layout", refuse)
    with pytest.raises(ConfigError, match=r"^parallel.layout=auto: none of the \d+ layouts that fit is accepted "
                                          r"on this device: refused here; or leave out train.recompute for the "
                                          r"search to choose$"):
        choose(cfg, 4, CPU, {"train.recompute"})


def test_nothing_fits_and_a_stopped_search_are_one_line(tiny_choice):
    cfg, _ = tiny_choice
    small = Hardware(name="cpu-test", memory_gb=0.001, gpus_per_node=4)
    with pytest.raises(ConfigError, match=r"^parallel.layout=auto: none of the \d+ valid layouts of 4 × cpu-test fits "
                                          r"in 1.00 MB per GPU; use more ranks \(run.nproc, or torchrun's\), a "
                                          r"smaller train.micro_batch or train.seq_len, or a smaller model$"):
        choose(cfg, 4, small, set())
    with pytest.raises(ConfigError, match=r"fits in 1.00 MB per GPU with zero.stage=0 kept as given; use more ranks .*, "
                                          r"or a smaller model; or leave out zero.stage for the search to choose$"):
        choose(cfg, 4, small, {"zero.stage"})

    def interrupt(done, total, best):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(ConfigError, match=r"the search was stopped after 3 of \d+ layouts \(Ctrl-C\); nothing was "
                                          "started"):
        choose(cfg, 4, CPU, set(), interrupt)


def test_a_fixed_key_nothing_fits_with_is_one_line_before_spawning(monkeypatch, capsys):
    monkeypatch.setattr(layout_auto, "local_hardware", lambda *a: CPU)
    # (the multiprocess tests' guard fails this test if anything is spawned)
    assert cli(["train", *TINY, "--parallel.pp", "3"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert errors == ["fivefold train: error: parallel.layout=auto: no valid layout of 4 ranks for this model with "
                      "parallel.pp=3 kept as given (0 candidates passed the rule table); change the number of ranks "
                      "(run.nproc, or torchrun's); or leave out parallel.pp for the search to choose"], err
    assert "Traceback" not in err


def test_a_resume_keeps_the_stored_choice_while_its_layout_holds(tmp_path, tiny_choice):
    cfg, choice = tiny_choice
    record = choice.record()
    (tmp_path / "fivefold.json").write_text(json.dumps({"steps_done": 3, "layout_auto": record}))
    trained = apply(cfg, record)
    run = validate_layout(trained, 4)
    plan = RunPlan(run.dims, run.global_batch, run.micro_batch, run.grad_accum, run.model, resume_from=tmp_path)
    kept = with_choice(plan, trained, None)
    assert kept.layout_auto == record and "(resumed without --layout auto: the layout kept)" in kept.notes[-1]
    other = copy.deepcopy(trained)
    other.parallel.tp, other.parallel.dp = 2, 2
    assert with_choice(plan, other, None).layout_auto is None  # a resume into another layout
    fresh = with_choice(RunPlan(run.dims, 32, 8, 1, run.model), trained, record)
    assert fresh.layout_auto == record and fresh.notes == (layout_auto.note(record),)


def test_rank0_searches_and_every_rank_takes_its_choice_or_its_error(monkeypatch, tiny_choice):
    import torch.distributed as dist

    cfg, choice = tiny_choice
    record = choice.record()
    sent = {}
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objs, src: objs.__setitem__(0, sent["value"]))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    sent["value"] = ("chosen", record)
    trained, got = layout_auto.resolve_on_rank0(cfg, 4, 4, "cpu", set())
    assert got == record and trained.to_dict() == apply(cfg, record).to_dict()
    sent["value"] = ("error", "parallel.layout=auto: none fits")
    with pytest.raises(ConfigError, match="^parallel.layout=auto: none fits$"):
        layout_auto.resolve_on_rank0(cfg, 4, 4, "cpu", set())
    manual = load_config(None, ["--nproc", "4"])
    assert layout_auto.resolve_on_rank0(manual, 4, 4, "cpu", set()) == (manual, None)  # no collective


def test_plan_says_it_plans_the_degrees_as_given(capsys):
    assert cli(["plan", "--gpus", "4", "--model", "tiny", "--seq", "32", "--layout", "auto"]) == 0
    assert "note: parallel.layout=auto: this plan is of the degrees as given; --search ranks" in capsys.readouterr().out


def test_help_shows_the_key_and_the_flag(capsys):
    assert "layout='manual'" in describe_keys()
    with pytest.raises(SystemExit):
        cli(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--layout (= parallel.layout)" in out and "layout='manual'" in out


@pytest.mark.multiprocess
def test_layout_auto_trains_the_chosen_layout_at_world_4(tmp_path, capfd):
    args = [*TINY, "--steps", "3", "--train.eval_every", "0", "--run.out_dir", str(tmp_path), "--run.name", "auto",
            "--run.progress", "false", "--run.plot", "false"]
    assert cli(["train", *args]) == 0
    captured = capfd.readouterr()
    meta = json.loads((tmp_path / "auto" / "checkpoints" / "step-00000003" / "fivefold.json").read_text())
    record = meta["layout_auto"]
    chosen, runners = record["chosen"], record["runners_up"]
    # the table before the workers start: the chosen layout and the two runners-up, each with its predicted
    # peak per GPU and step time; the choice in the run's header
    lines = captured.out.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("fivefold train --layout auto: "))
    rows = lines[title + 3:title + 6]
    assert [row.split()[0] for row in rows] == ["1", "2", "3"] and len(runners) == 2
    for row, entry in zip(rows, [chosen, *runners]):
        assert entry["layout"] in row and ("MB" in row or "GB" in row) and " ms" in row
    assert f"fivefold: note: parallel.layout=auto chose {chosen['layout']}: " in captured.out
    assert "fivefold train --layout auto: listing the layouts" in captured.err
    # the planner says it fits, on the machine it measured
    stored_hw = record["hardware"]
    hardware = Hardware(**{**stored_hw, "gemm_efficiency": tuple(map(tuple, stored_hw["gemm_efficiency"])),
                           "gemm_tile": tuple(stored_hw["gemm_tile"])})
    assert record["world"] == 4 and hardware.name.startswith("cpu (4 ranks") and chosen["peak_bytes"] <= hardware.memory_gb * GB
    cfg = load_config(None, args)
    trained = apply(cfg, record)
    assert plan_layout(trained, 4, hardware).fits
    # the layout trained is the chosen one: the checkpoint's layout and stored config, the run's config record
    want = overrides_dict(chosen["overrides"])
    assert {k: meta["layout"][k] for k in ("tp", "pp", "cp", "dp", "ep", "zero")} == {
        "tp": int(want["parallel.tp"]), "pp": int(want["parallel.pp"]), "cp": int(want["parallel.cp"]),
        "dp": int(want["parallel.dp"]), "ep": int(want["parallel.ep"]), "zero": int(want["zero.stage"])}
    stored = meta["config"]
    assert stored["parallel"]["layout"] == "manual" and stored["train"]["recompute"] == want["train.recompute"]
    assert {k: str(v).lower() for k, v in stored["parallel"].items() if f"parallel.{k}" in want} == {
        k[len("parallel."):]: v for k, v in want.items() if k.startswith("parallel.")}
    first = json.loads((tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["kind"] == "config" and first["world"] == 4 and first["dp"] == int(want["parallel.dp"])
    assert first["train"]["global_batch"] == int(overrides_dict(record["batch_overrides"])["train.global_batch"])

    # --resume alone: the stored layout, no search (its choice kept in the next checkpoints)
    from fivefold.train.resume import resumed_config
    from fivefold.train.validate import validate

    resume = ["--resume", str(tmp_path / "auto"), "--steps", "5", "--run.out_dir", str(tmp_path)]
    again = resumed_config(None, resume)
    assert again.parallel.layout == "manual"
    plan = with_choice(validate(again, 4), again, None)
    assert plan.layout_auto == record and "the layout kept" in plan.notes[-1]
    # --resume --layout auto: a new search, the keys given now held (the stored layout's are not)
    told = resumed_config(None, [*resume, "--layout", "auto", "--parallel.tp", "2"])
    assert told.parallel.layout == "auto"
    new = choose(told, 4, CPU, given_keys(None, [*resume, "--layout", "auto", "--parallel.tp", "2"]))
    assert new.fixed == ["parallel.tp"] and all(p.dims.tp == 2 for p in new.plans)
    assert new.plans[0].global_batch == first["train"]["global_batch"]  # the resumed run's batch


def test_a_machine_that_cannot_be_measured_is_one_line(monkeypatch):
    """The CPU's calibration (a short launch of its own) failing is one ConfigError line naming what to do."""
    from fivefold.config import ConfigError, load_config
    from fivefold.train import layout_auto

    def broken(*_):
        raise RuntimeError("process 0 terminated with exit code 1\nTraceback ...")

    monkeypatch.setattr(layout_auto, "local_hardware", broken)
    cfg = load_config(None, ["--layout", "auto", "--run.nproc", "2"])
    with pytest.raises(ConfigError) as e:
        layout_auto.resolve(cfg, 2, 2, "cpu", set())
    assert "\n" not in str(e.value) and "could not measure this machine (process 0 terminated" in str(e.value)
    assert "give the layout" in str(e.value)
