"""Command line: ``fivefold train [--config run.toml] [--section.key value ...]`` and ``fivefold bench``; ``train``
defaults to the small Llama on this Python's stdlib sources, on 2 local CPU workers (under torchrun: its ranks)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import fivefold
from fivefold.config import ALIASES, ConfigError, load_config


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fivefold train", add_help=True,
        description="Train a Llama-style model (dp / ZeRO / tp / sp / pp). Every config key can be overridden as "
                    "--section.key value (e.g. --train.steps 50 --parallel.dp 2); short flags: "
                    + ", ".join(f"--{a} (= {k})" for a, k in ALIASES.items()))
    parser.add_argument("--config", help="TOML file with sections [model] [parallel] [zero] [train] [data] "
                                         "[precision] [pipeline] [run] [checkpoint]")
    parser.epilog = ("--resume [PATH]: continue the run from its latest complete checkpoint, or from the checkpoint "
                     "PATH; --overwrite: start over in a run directory that already holds a run")
    args, overrides = parser.parse_known_args(argv)
    import torch.multiprocessing as mp

    from fivefold.launch import Terminated
    from fivefold.train.trainer import run
    from fivefold.watchdog import Stalled

    try:
        cfg = load_config(args.config, overrides)
        run(cfg)
    except Terminated as e:
        print(f"fivefold train: {e}", file=sys.stderr)
        return 128 + 15  # the shell's code for a process ended by SIGTERM
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"fivefold train: error: {e}", file=sys.stderr)
        return 2
    except mp.ProcessRaisedException as e:  # a worker's error, its traceback printed above: the error itself, once
        last = [line for line in str(e).splitlines() if line.strip()][-1]
        print(f"fivefold train: error in a worker: {last}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"fivefold train: error: a worker was lost: {e}", file=sys.stderr)
        return 1
    except Stalled as e:
        print(f"fivefold train: error: {e}", file=sys.stderr)
        return 1
    return 0


def _bench(argv: list[str]) -> int:
    """ddp | zero | tp | pp | parallel | all: a source checkout's ``bench/run.py`` (not in the installed package)."""
    root = Path(fivefold.__file__).resolve().parent.parent
    if not (root / "bench" / "run.py").is_file():
        print("fivefold bench: the benchmarks ship with the source checkout (bench/ next to the fivefold package), "
              f"not with an installed package; none found in {root}. Clone the repository and run `fivefold bench` "
              "from an editable install (pip install -e .) or `python bench/run.py` there.", file=sys.stderr)
        return 2
    sys.path[:] = [str(root), *(p for p in sys.path if p != str(root))]  # this checkout's `bench` first
    from bench.run import main as bench_main

    return bench_main(argv)


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="fivefold export", description="Write a run's model as Hugging Face Llama safetensors + config.json "
                                            "(one parameter at a time, never the whole model in memory).")
    parser.add_argument("run", help="a run directory (its latest checkpoint), its checkpoints folder, or a checkpoint")
    parser.add_argument("--to", required=True, help="output directory")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights' dtype (fp32)")
    parser.add_argument("--max-shard-mb", type=float, default=2048.0, help="largest safetensors file (2048 MiB)")
    args = parser.parse_args(argv)
    from fivefold.checkpoint.hf import export_checkpoint
    from fivefold.data_parallel.mixed_precision import parse_dtype

    try:
        summary = export_checkpoint(args.run, args.to, parse_dtype(args.dtype), int(args.max_shard_mb * 2**20))
    except (ValueError, FileNotFoundError) as e:
        print(f"fivefold export: error: {e}", file=sys.stderr)
        return 2
    print(f"fivefold export: {summary['checkpoint']} (after {summary['steps_done']} steps) -> {args.to}: "
          f"{', '.join(summary['files'])}, {summary['bytes'] / 2**20:.1f} MiB of weights "
          f"(held at most {summary['peak_held_bytes'] / 2**20:.1f} MiB)")
    return 0


COMMANDS = {"train": _train, "bench": _bench, "export": _export}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"fivefold: unknown command '{argv[0]}'", file=sys.stderr)
        print("usage: fivefold {" + ",".join(COMMANDS) + "} [options]   (fivefold COMMAND --help)", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
