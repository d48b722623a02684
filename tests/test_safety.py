"""Nothing executed, nothing lost, nothing exposed: crafted checkpoints, escaping paths, full disks.

A crafted pickle (in DCP's `.metadata`, or in a saved object with its SHA-256 manifest resealed — it
is unsigned) would create a marker file, which must not exist; a pickle-only checkpoint is refused
naming `--trust-checkpoint`; names that lead out are refused; a second run on a held directory is
refused naming the holder, and the lock dies with it; a full disk stops in one line or warns and
trains on (docs/reliability.md#safety-nothing-executed-nothing-lost-nothing-exposed). The crafted
checkpoints come from a real `fivefold train` run, so those tests are `multiprocess`; the rest
aren't."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dist_utils import run_workers

from fivefold.checkpoint.manager import (
    CHECKPOINT_META,
    _file_digest,
    complete_checkpoints,
    find_checkpoint,
)
from fivefold.checkpoint.metadata import DCP_METADATA
from fivefold.cli import EXIT_CONFIG, EXIT_FAILED, EXIT_STOPPED, main

CLI = [sys.executable, "-c", "from fivefold.cli import main; raise SystemExit(main())"]
TINY = ["--preset", "tiny", "--nproc", "2", "--run.progress", "false", "--run.plot", "false",
        "--train.eval_every", "0", "--train.global_batch", "8", "--train.seq_len", "64"]


class _Touch:
    """Unpickled, it creates ``path`` (what any payload could do instead)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _train(out: Path, name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "train", *TINY, "--run.out_dir", str(out), "--run.name", name, *args],
                          capture_output=True, text=True, timeout=timeout)


def _reseal(ckpt: Path) -> None:
    """Rewrite the manifest to match the files as they are now, as whoever crafts a checkpoint can."""
    meta = json.loads((ckpt / CHECKPOINT_META).read_text())
    meta["files"] = {f.name: _file_digest(f) for f in sorted(ckpt.iterdir())
                     if f.is_file() and f.name != CHECKPOINT_META}
    (ckpt / CHECKPOINT_META).write_text(json.dumps(meta))


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return complete_checkpoints(dst / "checkpoints")[-1]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """A real run stopped after 2 of 12 steps by run.exit_after: exit 75 and a checkpoint to resume."""
    out = tmp_path_factory.mktemp("safety")
    done = _train(out, "base", "--steps", "12", "--run.exit_after", "2")
    assert done.returncode == EXIT_STOPPED, done.stdout + done.stderr
    assert "exit_after: stopped after 2 of 12 steps" in done.stdout
    return out


# -- loading never unpickles -----------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_a_pickle_in_dcp_metadata_never_runs_and_export_reads_the_json(stopped_run, tmp_path):
    ckpt = _copy_run(stopped_run / "base", tmp_path / "run")
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    _reseal(ckpt)
    assert main(["export", str(ckpt), "--to", str(tmp_path / "hf")]) == 0
    assert not marker.exists()
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.multiprocess
def test_a_checkpoint_with_only_dcps_pickle_is_refused_unless_trusted(stopped_run, tmp_path, capsys):
    """Another DCP user's checkpoint (or an older fivefold's) carries only the pickle: refused before any worker
    starts, naming --trust-checkpoint; trusted, a benign one loads (export and resume)."""
    ckpt = _copy_run(stopped_run / "base", tmp_path / "run")
    (ckpt / DCP_METADATA).unlink()
    benign = (ckpt / ".metadata").read_bytes()
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    _reseal(ckpt)
    for argv in (["export", str(ckpt), "--to", str(tmp_path / "hf")],
                 ["train", *TINY, "--steps", "12", "--run.out_dir", str(tmp_path), "--run.name", "run", "--resume"]):
        assert main(argv) == EXIT_CONFIG
        err = capsys.readouterr().err
        assert "--trust-checkpoint" in err and err.count("\n") == 1, err
    assert not marker.exists()
    (ckpt / ".metadata").write_bytes(benign)
    _reseal(ckpt)
    assert main(["export", str(ckpt), "--to", str(tmp_path / "hf"), "--trust-checkpoint"]) == 0
    assert not marker.exists()


@pytest.mark.multiprocess
def test_a_pickle_in_a_saved_object_never_runs(stopped_run, tmp_path):
    """The RNG state is an object DCP unpickles with weights_only=False by default: crafted, the resume is refused
    in one line and the payload does not run."""
    ckpt = _copy_run(stopped_run / "base", tmp_path / "run")
    marker = tmp_path / "pwned"
    md = json.loads((ckpt / DCP_METADATA).read_text())
    item = next(s for s in md["storage"] if s["fqn"] == "rng.rank0")
    buf = io.BytesIO()
    torch.save({"cpu": _Touch(marker)}, buf)  # what torch.load(weights_only=False) would run
    evil = buf.getvalue()
    data = (ckpt / item["file"]).read_bytes()
    (ckpt / item["file"]).write_bytes(data[:item["at"]] + evil + data[item["at"] + item["length"]:])
    delta = len(evil) - item["length"]
    for s in md["storage"]:
        if s["file"] == item["file"] and s["at"] > item["at"]:
            s["at"] += delta
    item["length"] = len(evil)
    (ckpt / DCP_METADATA).write_text(json.dumps(md))
    _reseal(ckpt)
    done = _train(tmp_path, "run", "--steps", "12", "--resume")
    assert done.returncode == EXIT_FAILED, done.stdout + done.stderr
    assert "rng.rank0" in done.stderr and "refused unread" in done.stderr, done.stderr
    assert not marker.exists()


@pytest.mark.multiprocess
def test_damaged_or_escaping_json_metadata_is_refused(stopped_run, tmp_path, capsys):
    ckpt = _copy_run(stopped_run / "base", tmp_path / "run")
    md = json.loads((ckpt / DCP_METADATA).read_text())
    md["storage"][0]["file"] = "../../elsewhere/__0_0.distcp"
    (ckpt / DCP_METADATA).write_text(json.dumps(md))
    _reseal(ckpt)
    assert main(["export", str(ckpt), "--to", str(tmp_path / "hf")]) == EXIT_CONFIG
    assert "only DCP's __<rank>_<n>.distcp files" in capsys.readouterr().err


# -- paths stay inside ------------------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_latest_may_only_name_a_step_directory_of_its_own_root(stopped_run, tmp_path, capsys):
    ckpt = _copy_run(stopped_run / "base", tmp_path / "run")
    other = _copy_run(stopped_run / "base", tmp_path / "elsewhere")
    root = ckpt.parent
    (root / "latest").write_text(f"../../elsewhere/checkpoints/{other.name}\n")
    with pytest.raises(ValueError, match="not a step-N directory of"):
        find_checkpoint("latest", root)
    assert main(["train", *TINY, "--steps", "12", "--run.out_dir", str(tmp_path), "--run.name", "run",
                 "--resume"]) == EXIT_CONFIG
    assert "latest names '../../elsewhere" in capsys.readouterr().err
    # a step directory that is a symlink out of the root is not one of its checkpoints
    (root / "latest").unlink()
    shutil.rmtree(ckpt)
    (root / "step-00000009").symlink_to(other)
    assert complete_checkpoints(root) == []


@pytest.mark.multiprocess
def test_manifest_names_outside_the_checkpoint_are_not_read(stopped_run, tmp_path, capsys):
    ckpt = _copy_run(stopped_run / "base", tmp_path / "run")
    meta = json.loads((ckpt / CHECKPOINT_META).read_text())
    meta["files"]["/etc/passwd"] = {"bytes": 1, "sha256": "0" * 64}
    meta["files"]["../../../etc/hostname"] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt / CHECKPOINT_META).write_text(json.dumps(meta))
    os.symlink("/etc/hostname", ckpt / "__9_0.distcp")
    meta["files"]["__9_0.distcp"] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt / CHECKPOINT_META).write_text(json.dumps(meta))
    assert main(["export", str(ckpt), "--to", str(tmp_path / "hf")]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "outside" in err and "symlink out of" in err and err.count("\n") == 1, err
    real = Path("/etc/passwd").stat().st_size
    assert f"{real} bytes" not in err  # the size of a file elsewhere is not revealed


def _hf_dir(tmp_path: Path) -> Path:
    """A 2-layer Llama exported as HF safetensors (fivefold export of a tiny model's checkpoint is slower)."""
    from safetensors.torch import save_file

    from fivefold.checkpoint.hf import HF_CONFIG, config_to_hf, hf_name
    from fivefold.models import LlamaConfig
    from fivefold.models.llama import Llama

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64)
    d = tmp_path / "hf"
    d.mkdir()
    tensors = {hf_name(n): p.detach().clone() for n, p in Llama(cfg).named_parameters()}
    save_file(tensors, str(d / "model.safetensors"))
    (d / HF_CONFIG).write_text(json.dumps(config_to_hf(cfg, torch.float32)))
    return d


def test_init_from_weight_files_must_stay_in_the_model_directory(tmp_path, capsys):
    d = _hf_dir(tmp_path)
    names = json.loads(json.dumps({k: "model.safetensors" for k in _keys(d / "model.safetensors")}))
    argv = ["train", *TINY, "--steps", "2", "--run.out_dir", str(tmp_path / "runs"), "--init-from", str(d)]
    for escape in ("../elsewhere.safetensors", "/etc/passwd"):
        first = next(iter(names))
        index = {"metadata": {}, "weight_map": {**names, first: escape}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        t0 = time.perf_counter()
        assert main(argv) == EXIT_CONFIG
        err = capsys.readouterr().err
        assert "outside" in err and escape in err and err.count("\n") == 1, err
        assert time.perf_counter() - t0 < 30  # before any worker
    (d / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    index = {"metadata": {}, "weight_map": {**names, next(iter(names)): "link.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(argv) == EXIT_CONFIG
    assert "symlink out of" in capsys.readouterr().err


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def test_init_from_without_weights_or_with_a_damaged_header_is_refused_before_spawning(tmp_path, capsys):
    d = _hf_dir(tmp_path)
    argv = ["train", *TINY, "--steps", "2", "--run.out_dir", str(tmp_path / "runs"), "--init-from", str(d)]
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(b"\xff" * 8 + data[8:40])  # a header length past the end
    assert main(argv) == EXIT_CONFIG
    assert "not a readable safetensors file" in capsys.readouterr().err
    (d / "model.safetensors").unlink()
    assert main(argv) == EXIT_CONFIG
    assert "neither model.safetensors nor" in capsys.readouterr().err


# -- one run per directory --------------------------------------------------------------------------------------

@pytest.mark.multiprocess
def test_a_second_run_or_resume_on_a_running_directory_is_refused_naming_the_holder(stopped_run, tmp_path, capsys):
    import socket

    _copy_run(stopped_run / "base", tmp_path / "run")
    first = subprocess.Popen([*CLI, "train", *TINY, "--run.out_dir", str(tmp_path), "--run.name", "run",
                              "--steps", "12", "--resume"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    lock = tmp_path / "run" / ".lock"
    deadline = time.time() + 60
    while time.time() < deadline and not (lock.exists() and str(first.pid) in lock.read_text()):
        time.sleep(0.02)
    try:
        for extra in (["--resume"], ["--overwrite"], []):
            code = main(["train", *TINY, "--run.out_dir", str(tmp_path), "--run.name", "run", "--steps", "12",
                         *extra])
            err = capsys.readouterr().err
            assert first.poll() is None, "the first run ended before the second was tried"
            assert code == EXIT_CONFIG, err
            if extra != []:  # (a plain new run may be refused first for the run it finds there)
                assert f"in use by pid {first.pid} on host {socket.gethostname()}" in err, err
    finally:
        out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 13))


@pytest.mark.multiprocess
def test_the_lock_dies_with_its_holder(tmp_path):
    from fivefold.train.run_lock import RunDirLocked, RunLock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from fivefold.train.run_lock import RunLock; RunLock(Path(sys.argv[1])).acquire(); "
                               "print('held', flush=True); time.sleep(600)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunDirLocked, match=f"in use by pid {holder.pid}"):
        RunLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    with RunLock(tmp_path):  # SIGKILLed: the kernel dropped its lock
        with pytest.raises(RunDirLocked, match=f"in use by pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    RunLock(tmp_path).acquire().release()


# -- a full disk ------------------------------------------------------------------------------------------------

@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs (root only: mounting needs it)."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root; the disk-full path is not exercised here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the disk-full path is not "
                    "exercised")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.multiprocess
def test_a_save_onto_a_full_disk_stops_in_one_line_or_warns_and_trains_on(tiny_disk, tmp_path):
    stop = _train(tmp_path, "stop", "--steps", "4", "--checkpoint.interval", "2", "--checkpoint.dir", str(tiny_disk))
    assert stop.returncode == EXIT_FAILED
    last = stop.stderr.strip().splitlines()[-1]
    assert "no space for checkpoint" in last and "ENOSPC" in last and str(tiny_disk) in last, stop.stderr
    assert "Traceback" not in stop.stdout
    assert not list(tiny_disk.glob(".partial-*"))
    warn = _train(tmp_path, "warn", "--steps", "4", "--checkpoint.interval", "2", "--checkpoint.dir",
                  str(tiny_disk), "--checkpoint.on_error", "warn")
    assert warn.returncode == 0, warn.stderr
    assert warn.stdout.count("training goes on (checkpoint.on_error=warn)") == 2, warn.stdout
    records = [json.loads(line) for line in (tmp_path / "warn" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["error"] for r in records if r["kind"] == "error"] == ["checkpoint not saved"] * 2


def _enospc_worker(root: str) -> str:
    """A save whose free-space check is fooled (another writer filled the disk after it): DCP's write fails."""
    import torch.distributed as dist

    from fivefold.checkpoint import manager
    from fivefold.checkpoint.pieces import Pieces

    manager._checkpoint_bytes = lambda state: 0  # noqa: E731 - the check passes, the write does not
    pieces = Pieces(torch.Size([1 << 20]), torch.float32)  # 4 MiB on a 2 MiB disk
    half = (1 << 20) // 2
    r = dist.get_rank()
    pieces.add((r * half,), torch.ones(half))
    try:
        manager.Checkpointer(Path(root)).save(1, {"model.w": pieces}, {})
    except manager.CheckpointSaveError as e:
        return str(e)
    return "saved"


@pytest.mark.multiprocess
def test_a_write_that_hits_enospc_removes_its_partial_and_says_so(tiny_disk):
    messages = run_workers(_enospc_worker, 2, str(tiny_disk))
    for m in messages:
        assert "no space left on device (ENOSPC)" in m and str(tiny_disk) in m and "partial files were removed" in m
    assert not list(tiny_disk.iterdir())  # no .partial left on the full disk


# -- bad input: one line, its exit code, before any worker -------------------------------------------------------

BAD_TRAIN = [
    (["--run.name", "../../x"], "must be one directory name"),
    (["--run.name", ""], "must be one directory name"),
    (["--overwrite", "--resume"], "contradict each other"),
    (["--data", ""], "data.path is empty"),
    (["--checkpoint.on_error", "ignore"], "choose stop or warn"),
]


@pytest.mark.parametrize("args,message", BAD_TRAIN, ids=[" ".join(a) for a, _ in BAD_TRAIN])
def test_bad_train_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert main(["train", *TINY, "--run.out_dir", str(tmp_path), *args]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written, nowhere


def test_a_run_that_cannot_fit_in_memory_is_refused_before_spawning(tmp_path, capsys):
    """A 13B-shaped model on 2 local ranks (~440 GB predicted): refused in seconds, naming the figures, the change
    that would fit and the override, instead of the OOM killer's SIGKILL after spawning."""
    t0 = time.perf_counter()
    thirteen_b = ["--model.dim", "5120", "--model.n_layers", "40", "--model.n_heads", "40", "--model.n_kv_heads",
                  "40", "--model.ffn_hidden", "13824"]
    assert main(["train", *TINY, "--run.out_dir", str(tmp_path), *thirteen_b]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "memory: this run needs about" in err and "--run.check_memory false" in err and err.count("\n") == 1
    assert time.perf_counter() - t0 < 10
    assert list(tmp_path.iterdir()) == []


def test_config_and_checkpoint_dir_problems_are_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "latin1.toml").write_bytes("[run]\nname = \"caf\xe9\"\n".encode("latin-1"))
    cases = [(["--config", str(tmp_path)], "a directory, not a TOML file"),
             (["--config", str(tmp_path / "latin1.toml")], "latin1.toml is not UTF-8 text"),
             (["--checkpoint.dir", str(tmp_path / "a-file")], "checkpoint.dir"),
             (["--run.out_dir", str(tmp_path / "a-file")], "is a file")]
    for args, message in cases:
        assert main(["train", *TINY, *args]) == EXIT_CONFIG, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_an_unreadable_data_file_is_one_line_before_spawning(tmp_path, capsys, monkeypatch):
    """(As root every file is readable: the permission is taken away where fivefold asks for it.)"""
    from fivefold.train import corpus

    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_text("hello " * 4000)
    (data / "b.txt").write_text("world " * 4000)
    if os.geteuid() != 0:
        (data / "b.txt").chmod(0)
    else:
        monkeypatch.setattr(corpus.os, "access", lambda p, mode: Path(p).name != "b.txt")
    assert main(["train", *TINY, "--run.out_dir", str(tmp_path / "runs"), "--data", str(data)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "cannot be read" in err and "b.txt" in err and err.count("\n") == 1, err


@pytest.mark.multiprocess
def test_export_refuses_bad_sizes_and_targets_in_one_line(stopped_run, tmp_path, capsys):
    ckpt = complete_checkpoints(stopped_run / "base" / "checkpoints")[-1]
    (tmp_path / "a-file").write_text("x")
    for args, code, message in ((["--max-shard-mb", "0"], EXIT_CONFIG, "--max-shard-mb 0: give a positive size"),
                                (["--max-shard-mb", "-1"], EXIT_CONFIG, "--max-shard-mb -1"),
                                (["--to", str(tmp_path / "a-file")], EXIT_CONFIG, "is a file"),
                                (["--to", "/proc/version/hf"], EXIT_FAILED, "/proc/version")):
        argv = ["export", str(ckpt), *(["--to", str(tmp_path / "hf")] if "--to" not in args else []), *args]
        assert main(argv) == code, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
