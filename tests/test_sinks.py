"""Metric sinks (`logging.sinks`, fivefold/train/sinks.py) and the console lines.

One spawn (`multiprocess`): 2 gloo ranks train a tiny MoE model with every sink, the fourth step
raising in both workers (the trainer patched inside the spawned function); TensorBoard's event
files, the W&B offline run file and the MLflow file store then hold steps 1..3 with metrics.jsonl's
values, closed as failed, and stdout one line per log step. In-process: the sink names and the
missing-package, database-store and online-W&B-credentials lines before any spawn, `SinkLog` with
fake sinks (values, flushes, closes; a failing one turned off with one line, the run's end still
run), the trainer's peak device memory carried on an accelerator (a fake device module) and left
out on the CPU,
TensorBoard + MLflow closed at a run's normal end, every line above the progress bar, and a resume
keeping the records of the steps done."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import struct
import sys
from pathlib import Path

import pytest
import torch

from fivefold.config import ConfigError, LoggingSection, load_config
from fivefold.distributed.comm import CommTotals
from fivefold.train.metrics import EvalResult, StepResult, Throughput, TrainResult

STEPS, FAIL_AT = 4, 3  # the 4th step (0-based 3) raises: steps 1..3 are logged
MODEL = ["--preset", "tiny-moe", "--model.n_layers", "2", "--model.dim", "64", "--model.ffn_hidden", "128"]


def _config(out_dir: Path, sinks: str = "jsonl,tensorboard,wandb,mlflow", *extra: str):
    return load_config(None, [*MODEL, "--steps", str(STEPS), "--nproc", "2", "--run.out_dir", str(out_dir),
                              "--run.name", "watched", "--run.progress", "false", "--run.plot", "false",
                              "--train.seq_len", "32", "--train.global_batch", "4", "--train.eval_every", "2",
                              "--train.eval_batches", "2", "--data.max_bytes", "100000", "--run.peak_tflops", "1",
                              "--logging.sinks", sinks, "--logging.wandb_mode", "offline", *extra])


def _train_failing(cfg, plan, fail_at: int):
    """In each worker: the trainer whose step ``fail_at`` (0-based) raises (a test-only fault)."""
    from fivefold.train import trainer

    original = trainer.Trainer.train_step

    def train_step(self, step: int):
        if step == fail_at:
            raise RuntimeError(f"test fault in step {step + 1}")
        return original(self, step)

    trainer.Trainer.train_step = train_step
    return trainer.train(cfg, plan)


def _expected(records: list[dict]) -> dict[str, dict[int, float]]:
    """Scalar name -> {step: value}, as every sink should hold them, from metrics.jsonl."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        step = r.get("step")
        if r["kind"] == "train":
            for key in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu", "model_state_mb",
                        "peak_memory_mb"):
                if r.get(key) is not None:  # (null or absent: left out of the sinks)
                    out.setdefault(key, {})[step] = r[key]
            for dim, t in r["comm_by_dim"].items():
                out.setdefault(f"comm_payload_bytes/{dim}", {})[step] = t["payload_bytes"]
                out.setdefault(f"comm_wire_bytes/{dim}", {})[step] = t["wire_bytes"]
        elif r["kind"] == "val":
            out.setdefault("val_loss", {})[step] = r["val_loss"]
        elif r["kind"] == "moe":
            for layer, load in r["layers"].items():
                c = load["tokens_per_expert"]
                out.setdefault(f"moe_load/{layer}", {})[step] = max(c) / (sum(c) / len(c))
    return out


def _wandb_records(path: Path):
    """The records of a W&B run file (.wandb): a header, then a LevelDB-style log of 32 KiB blocks
    whose chunks (CRC, length, type: full / first / middle / last) hold protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, part = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            yield record
            part = b""


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """One run of every sink whose 4th step raises in both workers: (run dir, metrics records,
    stdout, the error)."""
    import torch.multiprocessing as mp

    from fivefold.distributed.launch import launch_local
    from fivefold.train.validate import validate

    out = tmp_path_factory.mktemp("sinks")
    cfg = _config(out)
    plan = validate(cfg, 2)
    capture = out / "stdout.txt"
    saved = os.dup(1)
    with pytest.MonkeyPatch.context() as env, open(capture, "w") as f:
        for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # not the user's
            env.setenv(name, str(out / "wandb-home"))
        os.dup2(f.fileno(), 1)  # the workers inherit this process's stdout
        try:
            with pytest.raises(mp.ProcessRaisedException) as error:
                launch_local(_train_failing, 2, cfg, plan, FAIL_AT, threads=1, timeout_s=240.0)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
    run_dir = out / "watched"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, records, capture.read_text(), str(error.value)


@pytest.mark.multiprocess
def test_the_crash_is_recorded_one_based(crashed):
    _, records, _, error = crashed
    assert "test fault in step 4" in error
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert [r["step"] for r in records if r["kind"] == "moe"] == [1, 2, 3]
    assert [r["step"] for r in records if r["kind"] == "val"] == [2]
    (err,) = [r for r in records if r["kind"] == "error"]
    assert err["step"] == 4 and err["error"] == "RuntimeError" and "test fault" in err["message"]
    train = [r for r in records if r["kind"] == "train"]
    # the model state is measured from the second step: null before; no device memory on the CPU
    assert [r["model_state_mb"] is None for r in train] == [True, False, False]
    assert not any("peak_memory_mb" in r for r in train)
    for r in train:  # every dim of this layout carries data-parallel traffic: the same sums
        by_dim = r["comm_by_dim"]
        assert set(by_dim) == {"dp", "ep_dp"}, by_dim
        assert sum(t["payload_bytes"] for t in by_dim.values()) == r["comm_payload_bytes"] > 0
        assert sum(t["calls"] for t in by_dim.values()) == r["comm_calls"]


@pytest.mark.multiprocess
def test_console_has_one_line_per_log_step(crashed):
    _, _, stdout, _ = crashed
    lines = [line for line in stdout.splitlines() if re.match(r"step \d+/", line)]
    assert [line.split()[1] for line in lines] == ["1/4:", "2/4:", "3/4:"], stdout
    # the model state is measured from the second step on (once the optimizer state exists)
    assert all(re.fullmatch(r"step \d/4: loss \d+\.\d{3}, [\d,]+ tokens/s, \d+ ms/step, MFU \d+\.\d%"
                            + (r", model state \d+\.\d MB" if i else ""), line) for i, line in enumerate(lines)), lines
    assert "step 2: val loss" in stdout


@pytest.mark.multiprocess
def test_tensorboard_holds_the_steps_before_the_crash(crashed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, records, _, _ = crashed
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    expected = _expected(records)
    assert set(acc.Tags()["scalars"]) == set(expected)
    assert {"loss", "val_loss", "mfu", "comm_wire_bytes/dp", "moe_load/layers.1.feed_forward"} <= set(expected)
    for key, want in expected.items():
        events = acc.Scalars(key)
        assert [e.step for e in events] == sorted(want), key
        assert [e.value for e in events] == pytest.approx([want[s] for s in sorted(want)], rel=1e-6), key


@pytest.mark.multiprocess
def test_wandb_offline_run_holds_the_steps_and_failed(crashed):
    run_dir, records, _, _ = crashed
    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows: dict[int, dict[str, float]] = {}
    config, exit_code = None, None
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = rows.setdefault(record.history.step.num, {})
            row.update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "exit":
            exit_code = record.exit.exit_code
    assert exit_code == 1  # finished as failed
    assert config["train"]["steps"] == STEPS and config["logging"]["wandb_mode"] == "offline"
    assert sorted(rows) == [1, 2, 3]
    for key, want in _expected(records).items():
        assert {s: rows[s][key] for s in rows if key in rows[s]} == want, key


@pytest.mark.multiprocess
def test_mlflow_file_store_holds_the_steps_and_failed(crashed):
    run_dir, records, _, _ = crashed
    (meta,) = [m for m in (run_dir / "mlruns").glob("*/*/meta.yaml")]
    run = meta.parent
    assert "status: 4" in meta.read_text()  # FAILED
    assert "run_name: watched" in meta.read_text()
    assert (run / "params" / "train.steps").read_text() == str(STEPS)
    assert (run / "params" / "logging.sinks").read_text() == "jsonl,tensorboard,wandb,mlflow"
    for key, want in _expected(records).items():
        lines = [line.split() for line in (run / "metrics" / key).read_text().splitlines()]
        assert {int(s): float(v) for _, v, s in lines} == pytest.approx(want), key


# ------------------------------------------------------------------------------------------------
# in-process

def test_sink_names():
    assert LoggingSection().sink_names() == ()
    assert LoggingSection(sinks="jsonl, tensorboard,mlflow,tensorboard").sink_names() == ("tensorboard", "mlflow")
    with pytest.raises(ConfigError, match=r"logging.sinks='jsonl,tb': unknown sink 'tb'; choose a comma list of "
                                          r"jsonl, tensorboard, wandb, mlflow"):
        LoggingSection(sinks="jsonl,tb").sink_names()
    with pytest.raises(ConfigError, match="logging.wandb_mode='cloud': choose online, offline or disabled"):
        load_config(None, ["--logging.wandb_mode", "cloud"])


@pytest.mark.parametrize("sink,package", [("wandb", "wandb"), ("mlflow", "mlflow-skinny"),
                                          ("tensorboard", "tensorboard")])
def test_a_missing_package_is_one_line_before_spawning(tmp_path, monkeypatch, sink, package):
    from fivefold.train import trainer

    monkeypatch.setitem(sys.modules, {"mlflow-skinny": "mlflow"}.get(package, package), None)
    monkeypatch.setattr(trainer, "launch_local", lambda *a, **k: pytest.fail("spawned"))
    cfg = _config(tmp_path, f"jsonl,{sink}")
    with pytest.raises(ConfigError) as e:
        trainer.run(cfg)
    assert str(e.value) == (f"logging.sinks={sink} needs the {package} package: pip install 'fivefold[logging]' "
                            f"(or pip install {package})")
    assert not (tmp_path / "watched").exists()


@pytest.mark.parametrize("uri", ["sqlite:///runs/mlflow.db", "postgresql+psycopg2://u@host/db"])
def test_a_database_mlflow_store_without_sqlalchemy_is_one_line_before_spawning(tmp_path, monkeypatch, uri):
    from fivefold.train import trainer

    monkeypatch.setitem(sys.modules, "alembic", None)  # (find_spec: None for a module set to None)
    monkeypatch.setattr(trainer, "launch_local", lambda *a, **k: pytest.fail("spawned"))
    with pytest.raises(ConfigError) as e:
        trainer.run(_config(tmp_path, "jsonl,mlflow", "--logging.mlflow_uri", uri))
    missing = "alembic" if importlib.util.find_spec("sqlalchemy") else "sqlalchemy and alembic"
    assert str(e.value) == (f"logging.mlflow_uri={uri} is a database store: it needs {missing}, which "
                            "mlflow-skinny lacks: pip install mlflow")
    assert not (tmp_path / "watched").exists()
    from fivefold.train.sinks import check_sink_packages

    check_sink_packages(_config(tmp_path, "jsonl,mlflow", "--logging.mlflow_uri", "http://localhost:5000"))
    check_sink_packages(_config(tmp_path, "jsonl,tensorboard", "--logging.mlflow_uri", uri))  # no mlflow sink


def test_online_wandb_without_credentials_is_one_line_before_spawning(tmp_path, monkeypatch):
    from fivefold.train import trainer
    from fivefold.train.sinks import check_sink_packages

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login user password secret\n")
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setattr(trainer, "launch_local", lambda *a, **k: pytest.fail("spawned"))
    online = _config(tmp_path, "jsonl,wandb", "--logging.wandb_mode", "online")
    with pytest.raises(ConfigError) as e:
        trainer.run(online)
    assert str(e.value) == ("logging.wandb_mode=online: W&B finds no credentials (WANDB_API_KEY or a netrc entry "
                            "for api.wandb.ai): run `wandb login`, set WANDB_API_KEY, or give --logging.wandb_mode "
                            "offline")
    assert not (tmp_path / "watched").exists()
    by_env = load_config(None, ["--logging.sinks", "wandb"])  # no logging.wandb_mode: WANDB_MODE's
    check_sink_packages(by_env)  # offline by default
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match=r"^WANDB_MODE=online: W&B finds no credentials"):
        check_sink_packages(by_env)
    netrc.write_text("machine api.wandb.ai login user password " + "k" * 40 + "\n")  # `wandb login`'s entry
    check_sink_packages(online)
    netrc.write_text("")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    check_sink_packages(online)
    check_sink_packages(_config(tmp_path, "jsonl,wandb"))  # offline: no credentials asked


class _FailingSink:
    """A sink whose sends (from ``fail_from`` on) and close raise, as an unreachable server's."""

    def __init__(self, log: list, fail_from: int) -> None:
        self.log, self.fail_from = log, fail_from

    def scalars(self, step, values):
        self.log.append(("down", step))
        if step >= self.fail_from:
            raise ConnectionError("server unreachable")

    def flush(self):
        pass

    def close(self, failed=False):
        self.log.append(("down close", failed))
        raise ConnectionError("still unreachable")


def test_a_failing_sink_is_turned_off_with_one_line_and_the_run_finishes(tmp_path, monkeypatch):
    from fivefold.train import sinks
    from fivefold.train.metrics import RunRecord, RunRecordLog

    log: list = []
    monkeypatch.setattr(sinks, "open_sinks", lambda cfg, run_dir, start: [_FailingSink(log, 2), _FakeSink(log)])
    record = RunRecord(tmp_path, 3, progress=True, name="r")
    said: list[str] = []
    record.progress.bar.write = said.append  # what `say` writes above the bar
    tp = Throughput(64, 100.0, None, 2)
    observers = [RunRecordLog(record, _NoMoE(), tp, "r"), sinks.SinkLog(tmp_path, tp, _NoMoE(), record.say)]
    observers[1].on_run_start(_info(_config(tmp_path)))  # (the record's start needs a model config)
    for step in range(3):
        for o in observers:
            o.on_step_end(_step(step))
    for o in reversed(observers):  # the trainer's order at the end
        o.on_run_end(TrainResult(3, 2.0, 2.0, None, 10, 256.0, None, 3.0))
    assert [e[:2] for e in log if e[0] != "flush"] == [
        ("down", 1), ("scalars", 1), ("down", 2), ("scalars", 2), ("scalars", 3), ("close", False),
        ("down close", True)]  # turned off at step 2, the others go on; closed as failed at the end
    warnings = [line for line in said if "warning" in line]
    assert warnings == ["fivefold: warning: metric sink _failing failed at step 2 (ConnectionError: server "
                        "unreachable); turned off, training goes on (metrics.jsonl keeps every record)"]
    assert (tmp_path / "loss.png").exists()  # the run record's end ran after the sinks'
    assert read_summary(tmp_path)["final_loss"] == 2.0


def test_a_sink_that_does_not_close_is_a_warning_line(tmp_path, monkeypatch):
    from fivefold.train import sinks

    log: list = []
    said: list[str] = []
    monkeypatch.setattr(sinks, "open_sinks", lambda cfg, run_dir, start: [_FailingSink(log, 99), _FakeSink(log)])
    observer = sinks.SinkLog(tmp_path, Throughput(64, 100.0, None, 2), _NoMoE(), said.append)
    observer.on_run_start(_info(_config(tmp_path)))
    observer.on_run_end(TrainResult(0, 2.0, 2.0, None, 10, 256.0, None, 3.0))  # no raise
    assert said == ["fivefold: warning: metric sink _failing did not close (ConnectionError: still unreachable)"]
    assert log == [("down close", False), ("close", False)]
    said.clear()
    observer.on_run_start(_info(_config(tmp_path)))
    observer.on_run_abort(0, RuntimeError("x"))
    assert said == ["fivefold: warning: metric sink _failing did not close (ConnectionError: still unreachable)"]


def test_peak_memory_is_carried_on_an_accelerator_and_left_out_on_the_cpu(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from fivefold.train import sinks
    from fivefold.train.metrics import RunRecord, RunRecordLog, TrainingClock, read_metrics
    from fivefold.train.trainer import Trainer

    asked = []

    class FakeDeviceModule:
        @staticmethod
        def max_memory_allocated(device):
            asked.append(device)
            return 3 * 2**20

    modules = {"cuda": FakeDeviceModule}
    monkeypatch.setattr(torch, "get_device_module", lambda kind: modules[kind])  # (the CPU: a KeyError)
    tp = Throughput(64, 100.0, None, 2)
    trainer = SimpleNamespace(cfg=_config(tmp_path), clock=TrainingClock(), throughput=tp, model_state_mb=0.0,
                              device=torch.device("cuda"), _fetch=lambda loss, norm: (2.0, None),
                              replicas=SimpleNamespace(live=None))
    record = RunRecord(tmp_path, 3, progress=False, name="r")
    written = RunRecordLog(record, _NoMoE(), tp, None)
    on_gpu = Trainer._result(trainer, 0, 0.5, torch.tensor(2.0), None, CommTotals(), {})
    assert on_gpu.peak_memory_mb == 3.0 and asked == [torch.device("cuda")]
    assert Trainer._result(trainer, 1, 0.5, torch.tensor(2.0), None, CommTotals(), {}).peak_memory_mb == 3.0
    values = sinks.step_scalars(on_gpu, tp, None)
    assert values["peak_memory_mb"] == 3.0 and "model_state_mb" not in values  # not measured yet: left out
    written.on_step_end(on_gpu)
    trainer.device, trainer.model_state_mb = torch.device("cpu"), 5.0
    on_cpu = Trainer._result(trainer, 2, 0.5, torch.tensor(2.0), None, CommTotals(), {})
    assert on_cpu.peak_memory_mb is None and len(asked) == 2  # no device module asked on the CPU
    from fivefold.train.trainer import peak_memory_mb

    # meta (the GPU path's dry runs) has no device module: left out, never an error
    assert peak_memory_mb(torch.device("meta")) is None and len(asked) == 2
    values = sinks.step_scalars(on_cpu, tp, None)
    assert "peak_memory_mb" not in values and values["model_state_mb"] == 5.0
    written.on_step_end(on_cpu)
    record.abort()
    train = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["model_state_mb"], r.get("peak_memory_mb", "absent")) for r in train] == [(None, 3.0), (5.0, "absent")]


def read_summary(run_dir: Path) -> dict:
    from fivefold.train.metrics import read_metrics

    (summary,) = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "summary"]
    return summary


class _FakeSink:
    def __init__(self, log: list) -> None:
        self.log = log

    def scalars(self, step, values):
        self.log.append(("scalars", step, dict(values)))

    def flush(self):
        self.log.append(("flush",))

    def close(self, failed=False):
        self.log.append(("close", failed))


class _NoMoE:
    def moe_load(self):
        return None


def _step(step: int, logged: bool = True) -> StepResult:
    traffic = {"dp": CommTotals(2, 10, 40, 40.0), "tp": CommTotals(1, 5, 20, 10.0)}
    return StepResult(step, 0.5, 64, torch.tensor(2.0), None, CommTotals(), 3.0, logged,
                      2.0 if logged else None, 0.25 if logged else None, None, traffic)


def _info(cfg, start: int = 0):
    from fivefold.train.metrics import RunInfo

    return RunInfo(cfg, None, 10, 2, 2, start, None, (), "dp=2", "data")


def test_sink_log_sends_each_log_step_once_and_closes(tmp_path, monkeypatch):
    from fivefold.train import sinks

    log: list = []
    monkeypatch.setattr(sinks, "open_sinks", lambda cfg, run_dir, start: [_FakeSink(log)])
    tp = Throughput(64, 100.0, None, 2)
    observer = sinks.SinkLog(tmp_path, tp, _NoMoE(), pytest.fail)
    observer.on_run_start(_info(_config(tmp_path)))
    observer.on_step_end(_step(0))
    observer.on_step_end(_step(1, logged=False))
    observer.on_eval(EvalResult(1, 1.5))
    observer.on_run_end(TrainResult(2, 2.0, 2.0, 1.5, 10, 256.0, None, 3.0))
    first = {"loss": 2.0, "lr": 0.5, "step_time_s": 0.25, "tokens_per_s": 256.0, "model_state_mb": 3.0,
             "comm_payload_bytes/dp": 40.0, "comm_wire_bytes/dp": 40.0, "comm_payload_bytes/tp": 20.0,
             "comm_wire_bytes/tp": 10.0}  # no grad_norm, no MFU (no peak): left out
    assert log == [("scalars", 1, first), ("flush",), ("scalars", 2, {"val_loss": 1.5}), ("flush",),
                   ("close", False)]
    log.clear()
    observer.on_run_start(_info(_config(tmp_path)))
    observer.on_run_abort(0, RuntimeError("x"))
    assert log == [("close", True)]


def test_sink_log_closes_every_sink_when_one_fails_to_open(tmp_path, monkeypatch):
    from fivefold.train import sinks

    log: list = []

    def broken(*a, **k):
        raise OSError("no such server")

    monkeypatch.setattr(sinks, "TensorBoardSink", lambda *a, **k: _FakeSink(log))
    monkeypatch.setattr(sinks, "MLflowSink", broken)
    with pytest.raises(OSError, match="no such server"):
        sinks.open_sinks(_config(tmp_path, "tensorboard,mlflow"), tmp_path, 0)
    assert log == [("close", True)]


@pytest.mark.multiprocess  # (MLflow asks `uname -p` in a subprocess)
def test_tensorboard_and_mlflow_at_a_normal_end(tmp_path, monkeypatch):
    """The real sinks through `SinkLog` in this process: events and the MLflow run FINISHED."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fivefold.train import sinks

    # set, then deleted: the undo removes what the sink sets (no MLFLOW_ALLOW_FILE_STORE after it)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset by this test")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    cfg = _config(tmp_path, "tensorboard,mlflow")
    observer = sinks.SinkLog(tmp_path, Throughput(64, 100.0, 1e6, 2), _NoMoE(), pytest.fail)
    observer.on_run_start(_info(cfg))
    for step in range(3):
        observer.on_step_end(_step(step))
    observer.on_run_end(TrainResult(3, 2.0, 2.0, None, 10, 256.0, None, 3.0))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("mfu")] == [(s, pytest.approx(64 * 100 / 0.25 / 1e6))
                                                              for s in (1, 2, 3)]
    (meta,) = (tmp_path / "mlruns").glob("*/*/meta.yaml")
    assert "status: 3" in meta.read_text()  # FINISHED
    lines = (meta.parent / "metrics" / "comm_wire_bytes" / "tp").read_text().split("\n")
    assert [line.split()[1:] for line in lines if line] == [["10.0", "1"], ["10.0", "2"], ["10.0", "3"]]
    assert not math.isnan(float(lines[0].split()[1]))


def test_with_the_bar_every_line_goes_above_it(tmp_path, capsys):
    import inspect

    from fivefold.train.metrics import RunRecord

    record = RunRecord(tmp_path, 3, progress=True, name="r")
    written: list[str] = []
    record.progress.bar.write = written.append
    record.say("hello")
    assert written == ["hello"] and capsys.readouterr().out == ""
    assert inspect.getsource(RunRecord).count("print(") == 1  # say's own, for a run without the bar
    record.abort()
    record.say("after the bar")
    assert capsys.readouterr().out == "after the bar\n"


def test_a_resume_keeps_the_records_of_the_steps_done(tmp_path):
    from fivefold.train.metrics import RunRecord, read_metrics

    lines = [{"kind": "config"}] + [{"kind": "train", "step": s} for s in range(1, 6)]
    lines += [{"kind": "checkpoint", "step": 3, "steps_done": 3}, {"kind": "error", "step": 4}, {"kind": "summary"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    record = RunRecord(tmp_path, 6, progress=False, name="r", resume_at=3)
    record.abort()
    kept = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r.get("step")) for r in kept] == [("config", None), ("train", 1), ("train", 2),
                                                          ("train", 3), ("checkpoint", 3)]
