"""Command line: ``fivefold train [--config run.toml] [--section.key value ...]``,
``fivefold plan --gpus N ...`` (what a layout costs, before renting GPUs), ``fivefold bench``,
``fivefold export``, ``fivefold prepare`` (text to token shards), ``fivefold generate`` and
``fivefold eval`` (use the model). ``train`` defaults to the
small Llama on this Python's stdlib sources, on 2 local CPU workers (under torchrun: its ranks).
Every error is one line; the exit codes are the EXIT_* constants below (0 done, 1 failed, 2 refused
before starting, 75 stopped early with a checkpoint, 143 stopped by a signal without one)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import json
import re
import sys
import textwrap
from pathlib import Path

import fivefold
from fivefold.config import ALIASES, ConfigError, load_config


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fivefold train",
        add_help=True,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Train a transformer (dp / ZeRO / tp / sp / pp / cp / ep). Every config key can be "
            "set in a TOML file (--config) or overridden as --section.key value (e.g. "
            "--train.steps 50 --parallel.dp 2); short flags: "
            + ", ".join(f"--{a} (= {k})" for a, k in ALIASES.items()),
            width=100,
        ),
    )
    parser.add_argument(
        "--config",
        help="TOML file with sections [model] [parallel] [zero] [train] [data] "
        "[precision] [pipeline] [run] [checkpoint]",
    )
    parser.add_argument("--profile", help=PROFILE_HELP)
    parser.epilog = train_epilog()
    args, overrides = parser.parse_known_args(argv)
    import logging

    import torch.multiprocessing as mp

    # torch's spawn logs "Terminating process N via signal SIGTERM" for the other workers once one
    # has failed: the failure is said below, once
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)

    from fivefold.distributed.launch import Terminated, lost_worker_reason
    from fivefold.distributed.watchdog import Stalled
    from fivefold.train.layout_auto import given_keys
    from fivefold.train.resume import resumed_config
    from fivefold.train.trainer import run

    try:
        cfg = resumed_config(args.config, overrides, profile=args.profile)
        # parallel.layout=auto holds the searched keys given here
        result = run(cfg, given_keys(args.config, overrides))
    except Terminated as e:
        print(f"fivefold train: {e}", file=sys.stderr)
        return EXIT_TERMINATED
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"fivefold train: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except (
        mp.ProcessRaisedException
    ) as e:  # a worker's error, its traceback printed above: the error itself, once
        print(f"fivefold train: error in a worker: {worker_error(e)}", file=sys.stderr)
        return EXIT_FAILED
    except mp.ProcessExitedException as e:
        print(f"fivefold train: error: {lost_worker_reason(e)}", file=sys.stderr)
        return EXIT_FAILED
    except Stalled as e:
        print(f"fivefold train: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:
        print(f"fivefold train: error: {os_error_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    # under torchrun every rank returns a result; a rank that stopped early with a checkpoint says
    # so in its code
    return EXIT_STOPPED if getattr(result, "stopped", None) else EXIT_DONE


def train_epilog() -> str:
    """`fivefold train --help`'s tail: resume / overwrite, the presets, every key with its default
    (from the schema) and where each is documented."""
    from fivefold.config import describe_keys
    from fivefold.models import PRESETS

    fill = functools.partial(textwrap.fill, width=100, break_on_hyphens=False)
    return "\n\n".join(
        [
            fill(
                "--resume [RUN]: continue a run (RUN: its directory, its checkpoints folder or a "
                "checkpoint; alone: this run's latest) with the config it was started with, only "
                "the keys given now changed; --overwrite: start over in a run directory that "
                "already holds a run"
            ),
            fill("model presets (--preset NAME): " + ", ".join(PRESETS)),
            "keys (--section.key VALUE) and their defaults (None: the preset's, or derived):\n"
            + describe_keys(),
            fill(
                "Each key is documented in docs/training.md (the run, data, batch, optimizer, "
                "optim, precision.fp8; "
                "logging: #watching-a-run; parallel.layout: #choosing-the-layout-automatically), "
                "docs/layouts.md (parallel, zero, pipeline, model.moe), "
                "docs/checkpoints.md (checkpoint, model.init_from, --resume), docs/reliability.md "
                "(run's timeouts and restarts, run.flight_recorder) and docs/tracing.md "
                "(run.trace, run.profile, run.memory_snapshot); the schema is fivefold/config.py."
            ),
        ]
    )


PROFILE_HELP = (
    "defaults for a kind of machine, under --config and the overrides: a name (gpu: "
    "configs/gpu.toml, bf16 parameters with fp32 reduction, log every 10 steps, defer_reduce, "
    "train.compile) or a TOML path"
)


def worker_error(e: BaseException) -> str:
    """The last line of a worker's traceback, with fivefold's own exception classes' module path
    dropped."""
    last = [line for line in str(e).splitlines() if line.strip()][-1]
    return re.sub(r"^fivefold(\.\w+)+\.(\w+): ", r"\2: ", last)


def os_error_line(e: OSError) -> str:
    """An OSError as one line: what failed, the path, the errno's name."""
    name = errno.errorcode.get(e.errno or 0)
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{' (' + name + ')' if name else ''}{where}"


def _bench(argv: list[str]) -> int:
    """ddp | zero | tp | pp | parallel | all: a source checkout's ``bench/run.py`` (not in the
    installed package)."""
    root = Path(fivefold.__file__).resolve().parent.parent
    if not (root / "bench" / "run.py").is_file():
        print(
            "fivefold bench: the benchmarks ship with the source checkout (bench/ next to the "
            f"fivefold package), not with an installed package; none found in {root}. Clone the "
            "repository and run `fivefold bench` from an editable install (pip install -e .) or "
            "`python bench/run.py` there.",
            file=sys.stderr,
        )
        return 2
    sys.path[:] = [
        str(root),
        *(p for p in sys.path if p != str(root)),
    ]  # this checkout's `bench` first
    from bench.run import main as bench_main

    return bench_main(argv)


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fivefold export",
        description="Write a run's model as Hugging Face safetensors + config.json + "
        "generation_config.json + the run's tokenizer, in the family that expresses it (Llama, "
        "Mistral, Qwen2/3, Mixtral, Qwen2/3-MoE, GLM-4.5-MoE, dots1), one tensor at a time, never "
        "the whole model in memory.",
    )
    parser.add_argument(
        "run",
        help="a run directory (its latest checkpoint), its checkpoints folder, or a checkpoint",
    )
    parser.add_argument("--to", required=True, help="output directory")
    parser.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights' dtype (fp32)"
    )
    parser.add_argument(
        "--max-shard-mb", type=float, default=2048.0, help="largest safetensors file (2048 MiB)"
    )
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="read a checkpoint whose metadata only DCP's pickle holds (another DCP program's or "
        "an older fivefold's): a pickle can run code, so only one from a source you trust",
    )
    parser.add_argument(
        "--family",
        default=None,
        help="the Hugging Face model_type to write (default: the plainest that expresses the "
        "model; e.g. qwen3 for a model with q/k norms)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the run's tokenizer.json (or its directory) when the recorded path has moved; "
        "checked against the sha256 the checkpoint recorded",
    )
    args = parser.parse_args(argv)
    from fivefold.checkpoint.hf import export_checkpoint
    from fivefold.data_parallel.mixed_precision import parse_dtype

    try:
        if not args.max_shard_mb > 0 or args.max_shard_mb == float("inf"):
            raise ValueError(
                f"--max-shard-mb {args.max_shard_mb:g}: give a positive size in MiB (e.g. 2048)"
            )
        to = Path(args.to)
        if to.exists() and not to.is_dir():
            raise ValueError(f"--to {to} is a file: give a directory (it is created if missing)")
        summary = export_checkpoint(
            args.run,
            to,
            parse_dtype(args.dtype),
            int(args.max_shard_mb * 2**20),
            trust=args.trust_checkpoint,
            family=args.family,
            tokenizer=args.tokenizer,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"fivefold export: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        print(f"fivefold export: error: {os_error_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"fivefold export: {summary['checkpoint']} (after {summary['steps_done']} steps) -> "
        f"{args.to}: {', '.join(summary['files'])}, {summary['bytes'] / 2**20:.1f} MiB of weights "
        f"(held at most {summary['peak_held_bytes'] / 2**20:.1f} MiB), as {summary['family']}"
    )
    for note in summary["notes"]:
        print(f"fivefold export: note: {note}")
    return 0


MODEL_HELP = (
    "a run directory (its latest checkpoint), its checkpoints folder, a checkpoint, or a Hugging "
    "Face model directory (config.json + safetensors of a family fivefold reads)"
)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments `generate` and `eval` share: which model, its tokenizer, device and dtype."""
    parser.add_argument("model", metavar="RUN|HF_DIR", help=MODEL_HELP)
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer (a tokenizer.json, its directory, a tiktoken file, bytes) when the "
        "run's recorded path has moved (checked against the sha256 its checkpoint recorded) or "
        "an HF directory holds none",
    )
    parser.add_argument(
        "--device", default="auto", help="auto (the accelerator if any, else the CPU), cpu, cuda"
    )
    parser.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights' dtype (fp32)"
    )
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="read a checkpoint whose metadata only DCP's pickle holds (as export's)",
    )


def _used_model(args: argparse.Namespace):  # noqa: ANN202 - a fivefold.use.model.UsedModel
    from fivefold.data_parallel.mixed_precision import parse_dtype
    from fivefold.distributed.launch import resolve_device
    from fivefold.use.model import load_model

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise ValueError(str(e).replace("run.device", "--device")) from None
    if not Path(args.model).exists():
        raise ValueError(f"{args.model} does not exist: give a run directory or an HF directory")
    return load_model(
        args.model,
        device=device,
        dtype=parse_dtype(args.dtype),
        tokenizer=args.tokenizer,
        trust=args.trust_checkpoint,
    )


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fivefold generate",
        description="Continue a prompt with a trained model (any layout it trained in: read whole "
        "into this one process) or a Hugging Face model; decoded with a KV cache, greedy at "
        "temperature 0, else sampled (temperature, top-p) from a seeded generator. Prints the "
        "prompt and its continuation.",
    )
    _model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new", type=int, default=64, help="new tokens at most (64)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sampled"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (1: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed (0)")
    parser.add_argument(
        "--bos", action="store_true", help="put the tokenizer's beginning-of-document id first"
    )
    args = parser.parse_args(argv)
    from fivefold.use.generate import Sampling, generate

    try:
        sampling = Sampling(args.temperature, args.top_p, args.seed).check()
        if not args.prompt:
            raise ValueError("--prompt is empty: give some text to continue")
        if args.max_new < 0:
            raise ValueError(f"--max-new {args.max_new}: give a number of tokens (0 or more)")
        used = _used_model(args)
        out = generate(used, args.prompt, args.max_new, sampling, add_bos=args.bos)
    except (ValueError, FileNotFoundError) as e:
        print(f"fivefold generate: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        print(f"fivefold generate: error: {os_error_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    print(out.text)
    if out.stopped == "context":
        print(
            f"fivefold generate: note: stopped after {out.new_tokens} new tokens, at the model's "
            f"context of {used.config.max_seq_len} tokens",
            file=sys.stderr,
        )
    return EXIT_DONE


def _eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fivefold eval",
        description="A model's loss (mean cross-entropy, as the trainer computes its validation "
        "loss) and perplexity on a prepared token directory's split or on text (tokenized with "
        "the run's tokenizer, an end-of-document id per document; its last data.val_fraction is "
        "the validation split), in the trainer's windows; the defaults are the run's.",
    )
    _model_arguments(parser)
    parser.add_argument(
        "--data", required=True, help="a fivefold prepare directory, a text file or folder"
    )
    parser.add_argument(
        "--split", default="val", choices=["train", "val"], help="which split (val)"
    )
    parser.add_argument(
        "--batches", type=int, default=None, help="batches (the run's train.eval_batches)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per window (the run's train.seq_len)"
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="windows per batch (the run's train.micro_batch)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a line")
    args = parser.parse_args(argv)
    from fivefold.use.evaluate import evaluate

    try:
        for flag in ("batches", "seq_len", "micro_batch"):
            value = getattr(args, flag)
            if value is not None and value <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} {value}: give a positive integer")
        if not Path(args.data).exists():
            raise ValueError(f"--data {args.data} does not exist")
        used = _used_model(args)
        report = evaluate(used, args.data, args.split, args.batches, args.seq_len, args.micro_batch)
    except (ValueError, FileNotFoundError) as e:
        print(f"fivefold eval: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        print(f"fivefold eval: error: {os_error_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(
            f"fivefold eval: {report.source} on {report.data} ({report.split}, {report.batches} "
            f"batches x {report.micro_batch} x {report.seq_len} tokens): loss {report.loss:.4f}, "
            f"perplexity {report.perplexity:.3f}"
        )
    return EXIT_DONE


def _prepare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fivefold prepare",
        description="Tokenize text into token shards for data.prepared (one pass; resumable: run "
        "the same command again after a stop). INPUT: a text file (one document), a folder (its "
        "text files, one document each, sorted; JSONL / Parquet files in it read as such), a "
        ".jsonl/.json file (one JSON object per line), a .parquet file, or a directory written by "
        "datasets' save_to_disk (a DatasetDict: its train split, else every split in sorted "
        "order). fivefold reads local files only; with network, a hub dataset goes through "
        'datasets: python -c "import datasets; datasets.load_dataset(NAME).save_to_disk(DIR)", '
        "then fivefold prepare DIR.",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT")
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="a tokenizer.json, a directory holding one, or a "
        "tiktoken BPE file (it needs an end-of-document token)",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (1)")
    parser.add_argument(
        "--text-field", default="text", help="JSONL field / Parquet or dataset column (text)"
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        help="share of documents for validation, by a hash of (seed, document) (0.005)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (0)")
    parser.add_argument(
        "--unit-mb",
        type=float,
        default=64.0,
        help="MiB of text per unit of work and shard: text files grouped, JSONL cut (64)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="start over in an --out a former prepare wrote"
    )
    args = parser.parse_args(argv)
    import time

    from fivefold.train.prepare import DEFAULT_VAL_FRACTION, prepare

    t0 = time.perf_counter()
    try:
        index = prepare(
            args.inputs,
            args.tokenizer,
            args.out,
            workers=args.workers,
            text_field=args.text_field,
            val_fraction=DEFAULT_VAL_FRACTION if args.val_fraction is None else args.val_fraction,
            seed=args.seed,
            overwrite=args.overwrite,
            unit_bytes=max(1, int(args.unit_mb * 2**20)),
            progress=sys.stderr.isatty(),
        )
    except KeyboardInterrupt:
        print(
            "fivefold prepare: stopped; the finished units are kept: run the same command again "
            "to go on",
            file=sys.stderr,
        )
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"fivefold prepare: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        print(f"fivefold prepare: error: {os_error_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    took = time.perf_counter() - t0
    train, val = index.splits["train"], index.splits["val"]
    print(
        f"fivefold prepare: {index.documents:,} documents ({train.documents:,} train, "
        f"{val.documents:,} val; {index.skipped_documents:,} empty skipped), {index.tokens:,} "
        f"tokens ({train.tokens:,} train, {val.tokens:,} val), {index.dtype}, {index.shards} "
        f"shards in {args.out}, {took:.1f} s, {index.tokens / max(took, 1e-9):,.0f} tokens/s"
    )
    return EXIT_DONE


# `fivefold plan`'s own short flags (besides train's): short spellings of the common layout knobs
PLAN_FLAGS = {
    "model": "model.preset",
    "gpus": None,
    "seq": "train.seq_len",
    "micro-batch": "train.micro_batch",
    "global-batch": "train.global_batch",
    "grad-accum": "train.grad_accum",
    "recompute": "train.recompute",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "cp": "parallel.cp",
    "ep": "parallel.ep",
    "dp": "parallel.dp",
    "schedule": "pipeline.schedule",
    "virtual": "pipeline.virtual",
}


def _plan(argv: list[str]) -> int:
    from fivefold.plan import (
        HARDWARE,
        SearchProgress,
        format_plan,
        format_search,
        plan_layout,
        search,
    )
    from fivefold.train.layout_auto import fixed_keys

    parser = argparse.ArgumentParser(
        prog="fivefold plan",
        description="Predict per-GPU memory (model states, transient buffers, activations), "
        "communication per step and dimension, pipeline bubble, step time and MFU of a layout "
        "before renting GPUs; --search ranks every layout that fits. Layout and model as for "
        "`fivefold train` (--config, --section.key value), plus the short flags below. Without "
        "--config the defaults are for GPUs, not train's CPU demo: bf16 parameters with fp32 "
        "gradient reduction (torchtitan's), one sequence per micro-batch of the model's context "
        "length, 4 × pp × virtual micro-batches under pp.",
        epilog="short flags: "
        + ", ".join(f"--{k} (= {v})" for k, v in PLAN_FLAGS.items() if v)
        + "; --sp (= "
        "--parallel.sp true); --zero N; e.g. fivefold plan --model llama3-70b --gpus 512 --tp 8 "
        "--pp 4 --zero 1 --micro-batch 1 --seq 8192 --global-batch 1024 --sp --recompute selective",
    )
    parser.add_argument("--config", help="a train TOML file: its layout, model and batch")
    parser.add_argument("--profile", help=PROFILE_HELP)
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job (the world size)")
    parser.add_argument(
        "--hardware", default="h100", choices=sorted(HARDWARE), help="GPU preset (default h100)"
    )
    parser.add_argument("--gpu-mem", type=float, help="GB per GPU (overrides the preset)")
    parser.add_argument(
        "--peak-tflops", type=float, help="peak dense TFLOP/s per GPU in the compute dtype"
    )
    parser.add_argument(
        "--efficiency",
        type=float,
        help="every matmul at this fraction of the peak, whatever its shape (default: the "
        "preset's table by GEMM shape, docs/plan.md#calibration)",
    )
    parser.add_argument(
        "--attention-efficiency", type=float, help="fraction of the peak the attention core reaches"
    )
    parser.add_argument(
        "--context-gb", type=float, help="GB per GPU of the CUDA context and its kernels"
    )
    parser.add_argument(
        "--comm-buffer-mb", type=float, help="MB of NCCL buffers per communicator a GPU is in"
    )
    parser.add_argument(
        "--allocator-reserve",
        type=float,
        help="the caching allocator's reserve, a fraction of the tensors' peak",
    )
    parser.add_argument("--intra-gbps", type=float, help="GB/s per GPU inside a node (NVLink)")
    parser.add_argument(
        "--inter-gbps", type=float, help="GB/s per GPU across nodes (InfiniBand / RoCE)"
    )
    parser.add_argument(
        "--gpus-per-node", type=int, help="GPUs sharing the intra-node link (default 8)"
    )
    parser.add_argument(
        "--search",
        action="store_true",
        help="rank every valid layout for --gpus that fits (tp, pp, cp, dp, ep, ZeRO stage and "
        "recompute given on the command line stay fixed)",
    )
    parser.add_argument(
        "--top", type=int, default=10, help="layouts shown by --search (10; at least 1)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--sp", action="store_true", help="sequence parallel (= --parallel.sp true)"
    )
    args, rest = parser.parse_known_args(argv)
    # bf16 unless a TOML file or the command line says otherwise
    overrides = [] if args.config else ["--precision.param", "bf16"]
    i = 0
    while i < len(rest):
        key = rest[i][2:].split("=", 1)[0] if rest[i].startswith("--") else ""
        if key in PLAN_FLAGS and PLAN_FLAGS[key]:
            value = (
                rest[i].split("=", 1)[1]
                if "=" in rest[i]
                else (rest[i + 1] if i + 1 < len(rest) else "")
            )
            overrides += [f"--{PLAN_FLAGS[key]}", value]
            i += 1 if "=" in rest[i] else 2
        else:
            overrides.append(rest[i])
            i += 1
    if args.sp:
        overrides += ["--parallel.sp", "true"]
    hw = HARDWARE[args.hardware]
    changes = {
        "memory_gb": args.gpu_mem,
        "peak_tflops": args.peak_tflops,
        "attention_efficiency": args.attention_efficiency,
        "context_gb": args.context_gb,
        "comm_buffer_mb": args.comm_buffer_mb,
        "allocator_reserve": args.allocator_reserve,
        "intra_node_gbps": args.intra_gbps,
        "inter_node_gbps": args.inter_gbps,
        "gpus_per_node": args.gpus_per_node,
    }
    hw = dataclasses.replace(hw, **{k: v for k, v in changes.items() if v is not None})
    given = {
        ALIASES.get(a[2:].split("=")[0], a[2:].split("=")[0])
        for a in overrides
        if a.startswith("--")
    }
    try:
        if args.efficiency is not None:
            hw = hw.with_efficiency(args.efficiency)
        hw.check()
        if args.gpus <= 0:
            raise ConfigError(f"--gpus {args.gpus}: give the number of GPUs in the job")
        cfg = load_config(
            args.config, [*overrides, "--run.nproc", str(args.gpus)], profile=args.profile
        )
        notes = [] if args.config else _plan_defaults(cfg, given)
        if cfg.parallel.layout == "auto" and not args.search:
            notes.append(
                "parallel.layout=auto: this plan is of the degrees as given; --search ranks the "
                "layouts fivefold train --layout auto chooses from"
            )
        if args.search:
            progress = SearchProgress(sys.stderr)
            try:
                # the user's keys stay, a given schedule too (train --layout auto holds the same)
                fixed = fixed_keys(cfg, given)
                found = search(cfg, args.gpus, hw, args.top, progress, fixed=fixed)
            finally:
                progress.close()
            for p in found.plans:
                p.notes[:0] = notes
            print(
                json.dumps([p.to_dict() for p in found.plans], indent=1)
                if args.json
                else format_search(found, args.gpus, hw)
            )
            if found.stopped:
                return 130
        else:
            plan = plan_layout(cfg, args.gpus, hw)
            plan.notes[:0] = notes
            print(json.dumps(plan.to_dict(), indent=1) if args.json else format_plan(plan))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        hint = (
            (
                " (fivefold plan's own flags: --gpus, --model, --seq, --micro-batch, "
                "--global-batch, --grad-accum, --tp, --pp, --cp, --ep, --sp, --recompute; see "
                "fivefold plan --help)"
            )
            if "unknown" in str(e)
            else ""
        )
        print(f"fivefold plan: error: {e}{hint}", file=sys.stderr)
        return 2
    return 0


def _plan_defaults(cfg, given: set[str]) -> list[str]:  # noqa: ANN001 - a Config
    """Planning defaults where the command line sets nothing (train's are for a CPU demo): one
    sequence per micro-batch of the model's context length, and under pp 4 × pp × virtual
    micro-batches so the pipeline fills."""
    from fivefold.models import get_config

    notes = []
    if "train.seq_len" not in given and not cfg.model.init_from:
        cfg.train.seq_len = get_config(cfg.model.preset).max_seq_len
        notes.append(f"--seq not given: the model's context, {cfg.train.seq_len} tokens")
    if "train.micro_batch" not in given:
        cfg.train.micro_batch = 1
    if cfg.parallel.pp > 1 and not given & {"train.grad_accum", "train.global_batch"}:
        cfg.train.grad_accum = 4 * cfg.parallel.pp * cfg.pipeline.virtual
        notes.append(
            f"--grad-accum / --global-batch not given: {cfg.train.grad_accum} micro-batches (4 × "
            "pp × virtual stages) so the pipeline fills"
        )
    return notes


# Exit codes of `fivefold train` (and export / plan where they apply), documented in
# docs/reliability.md#exit-codes.
EXIT_DONE = 0  # every step of train.steps done
EXIT_FAILED = 1  # the run failed: a worker's error, a lost or stalled worker, an I/O error
# refused before anything started: the config, data, a checkpoint, a locked run directory
EXIT_CONFIG = 2
# stopped early WITH a checkpoint (SIGTERM, SIGINT, run.exit_after): continue with --resume
EXIT_STOPPED = 75
EXIT_TERMINATED = (
    128 + 15
)  # stopped by a signal before the workers could save (the shell's SIGTERM code)

COMMANDS = {
    "train": _train,
    "plan": _plan,
    "bench": _bench,
    "export": _export,
    "prepare": _prepare,
    "generate": _generate,
    "eval": _eval,
}


# `fivefold --help`: what each command does, in one line
COMMAND_HELP = {
    "train": "train on local CPU workers or under torchrun (--help: the presets, every key)",
    "plan": "what a layout costs per GPU before renting GPUs; --search ranks every layout",
    "prepare": "tokenize text (files, JSONL, Parquet, datasets) into token shards for training",
    "export": "write a run's model as a Hugging Face model (safetensors, config, tokenizer)",
    "bench": "fivefold side by side with torch / DeepSpeed on this machine (a source checkout)",
    "generate": "decode text from a run or a Hugging Face model (greedy or sampled, a KV cache)",
    "eval": "a run's loss and perplexity on token shards or text, as the trainer measures it",
}


def usage() -> str:
    """`fivefold --help`: the commands, one line each, and where to read more."""
    width = max(map(len, COMMANDS))
    lines = [
        "usage: fivefold COMMAND [options]   (fivefold COMMAND --help for its options)",
        "",
        "commands:",
        *(f"  {name:{width}s}  {COMMAND_HELP.get(name, '')}" for name in COMMANDS),
        "",
        "The README's set-up is `make run` and `make test`; docs/ holds training.md (keys), "
        "layouts.md,",
        "checkpoints.md, data.md, use.md (generate, eval), plan.md, gpus.md and reliability.md.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            print(f"fivefold: unknown command '{argv[0]}'", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
