"""Multi-node as users run it: two torchrun "nodes" train like four local workers.

Two `torchrun --nnodes 2 --node-rank {0,1} --rdzv-backend c10d` invocations on 127.0.0.1, two
processes each, against four local workers (which the other tests hold to single-process training):
the same losses and, in the final checkpoint, the same parameters, bit for bit. `multiprocess`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiprocess  # every test here starts processes

ARGS = ["--preset", "tiny", "--steps", "4", "--run.progress", "false", "--run.plot", "false", "--train.eval_every",
        "0", "--train.global_batch", "8", "--train.seq_len", "64", "--checkpoint.interval", "4", "--zero", "1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def _params(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(ckpt, ckpt.parent / "all.pt")
    return {k: v for k, v in torch.load(ckpt.parent / "all.pt").items() if k.startswith("model.")}


def test_two_torchrun_nodes_train_like_four_local_workers(tmp_path):
    port = _free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"127.0.0.1:{port}", "--rdzv-id", "fivefold-test", "-m", "fivefold.train", *ARGS,
                               "--run.out_dir", str(tmp_path), "--run.name", "nodes"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(outs)
    assert "dp=4" in "".join(outs)
    subprocess.run([sys.executable, "-c", "from fivefold.cli import main; raise SystemExit(main())", "train", *ARGS,
                    "--nproc", "4", "--run.out_dir", str(tmp_path), "--run.name", "local"], check=True,
                   capture_output=True, timeout=300)
    assert _losses(tmp_path / "nodes") == _losses(tmp_path / "local")
    a = _params(tmp_path / "nodes" / "checkpoints" / "step-00000004")
    b = _params(tmp_path / "local" / "checkpoints" / "step-00000004")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
