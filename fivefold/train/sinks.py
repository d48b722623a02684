"""Metric sinks (``logging.sinks``): where rank 0's scalars go besides ``metrics.jsonl``, the run's
own record that `metrics.RunRecord` always writes. A `MetricSink` takes a step's scalars, flushes,
closes; one class per backend (`TensorBoardSink`, `WandbSink`, `MLflowSink`), each importing its
package only when opened; `SinkLog` is the observer that turns a `StepResult` / `EvalResult` into
one dict of scalars and hands it to every sink, numbered by steps done (1-based) as every record of
``metrics.jsonl``. `check_sink_packages` runs in `validate`, before any worker starts: packages,
a database store's packages, W&B credentials for an online run (docs/training.md#watching-a-run).
A sink that fails mid-run is turned off with one warning line; the run goes on."""

from __future__ import annotations

import importlib.util
import netrc
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from fivefold.config import ConfigError
from fivefold.train.metrics import (
    EvalResult,
    MoELoad,
    RunInfo,
    StepResult,
    Throughput,
    TrainObserver,
    TrainResult,
    moe_imbalance,
)

if TYPE_CHECKING:
    from fivefold.config import Config

__all__ = [
    "MLflowSink",
    "MetricSink",
    "SinkLog",
    "TensorBoardSink",
    "WandbSink",
    "check_sink_packages",
    "flatten",
    "open_sinks",
    "step_scalars",
]

# sink: (the module it imports, the package that installs it)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}


class MetricSink(Protocol):
    """Where scalars go: ``scalars`` per log step (and evaluation), ``flush`` after each, ``close``
    once (``failed``: the run stopped on an error)."""

    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self, failed: bool = False) -> None: ...


# MLflow's database stores (SQLAlchemy), a URI's scheme before any "+driver"
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
ONLINE_WANDB_MODES = ("online", "run", "shared")  # wandb's modes that talk to a server


def wandb_mode(cfg: Config) -> str:
    """``logging.wandb_mode``, else the environment's ``WANDB_MODE``, else offline."""
    return cfg.logging.wandb_mode or os.environ.get("WANDB_MODE") or "offline"


def _wandb_host() -> str:
    return urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc


def has_wandb_credentials() -> bool:
    """wandb (0.31) would find credentials: ``WANDB_API_KEY`` (or ``WANDB_IDENTITY_TOKEN_FILE``),
    else a netrc entry (``$NETRC``, else ``~/.netrc``) for the host of ``WANDB_BASE_URL``
    (api.wandb.ai)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    path = os.environ.get("NETRC") or "~/.netrc"
    try:
        entry = netrc.netrc(os.path.expanduser(path)).authenticators(_wandb_host())
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def check_sink_packages(cfg: Config) -> None:
    """Every sink ``logging.sinks`` names is known and its package installed; a database
    ``logging.mlflow_uri`` has SQLAlchemy and Alembic (which mlflow-skinny lacks); an online W&B
    run has credentials. Otherwise one `ConfigError` line saying what to do; nothing is
    imported."""
    names = cfg.logging.sink_names()
    for name in names:
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"logging.sinks={name} needs the {package} package: pip install "
                f"'fivefold[logging]' (or pip install {package})"
            )
    uri = cfg.logging.mlflow_uri
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else ""
    if "mlflow" in names and scheme in DATABASE_SCHEMES:
        missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"logging.mlflow_uri={uri} is a database store: it needs {' and '.join(missing)}, "
                "which mlflow-skinny lacks: pip install mlflow"
            )
    mode = wandb_mode(cfg)
    if "wandb" in names and mode in ONLINE_WANDB_MODES and not has_wandb_credentials():
        given = "logging.wandb_mode" if cfg.logging.wandb_mode else "WANDB_MODE"
        raise ConfigError(
            f"{given}={mode}: W&B finds no credentials (WANDB_API_KEY or a netrc entry for "
            f"{_wandb_host()}): run `wandb login`, set WANDB_API_KEY, or give "
            "--logging.wandb_mode offline"
        )


class TensorBoardSink:
    """Event files in ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``). ``purge_step``: a
    resumed run's first step; TensorBoard then hides the earlier attempt's events from there on."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (``wandb.init``): ``mode`` offline writes
    ``<dir>/wandb/offline-run-*`` with no network (``wandb sync`` uploads it later). wandb's console
    capture is off (the run's lines and the progress bar stay the run's own) and its start-up
    bounded (``init_timeout``)."""

    INIT_TIMEOUT_S = 60.0

    def __init__(
        self, run_dir: Path, name: str, project: str, mode: str, config: Mapping[str, Any]
    ) -> None:
        import wandb

        settings = wandb.Settings(console="off", silent=True, init_timeout=self.INIT_TIMEOUT_S)
        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(run_dir),
            mode=mode,
            config=dict(config),
            settings=settings,
        )

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)  # (an evaluation's scalars join the step's row)

    def flush(self) -> None:
        pass  # each log is handed to wandb's service process at once

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MLflowSink:
    """An MLflow run in experiment ``experiment`` at ``uri`` (default: a file store
    ``<run dir>/mlruns``, which MLflow 3 refuses unless ``MLFLOW_ALLOW_FILE_STORE=true``: set here
    for that default only); its params the flattened config; marked FINISHED or FAILED at the
    end."""

    PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch

    def __init__(
        self, run_dir: Path, name: str, uri: str, experiment: str, params: Mapping[str, Any]
    ) -> None:
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        self.run_id = client.create_run(experiment_id, run_name=name).info.run_id
        items = [Param(k, str(v)) for k, v in params.items()]
        for at in range(0, len(items), self.PARAMS_PER_CALL):
            client.log_batch(self.run_id, params=items[at : at + self.PARAMS_PER_CALL])

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()]
        )

    def flush(self) -> None:
        pass  # log_batch has written the store

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``{"train": {"lr": 1}}`` -> ``("train.lr", 1)``."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def open_sinks(cfg: Config, run_dir: Path, start_step: int) -> list[MetricSink]:
    """The sinks of ``logging.sinks``, opened in the order named (one failing closes those
    before)."""
    log, config = cfg.logging, cfg.to_dict()
    makers = {
        "tensorboard": lambda: TensorBoardSink(
            run_dir / "tensorboard", purge_step=start_step + 1 if start_step else None
        ),
        "wandb": lambda: WandbSink(
            run_dir,
            cfg.run.name,
            log.wandb_project,
            wandb_mode(cfg),
            config,
        ),
        "mlflow": lambda: MLflowSink(
            run_dir, cfg.run.name, log.mlflow_uri, log.mlflow_experiment, dict(flatten(config))
        ),
    }
    sinks: list[MetricSink] = []
    try:
        for name in log.sink_names():
            sinks.append(makers[name]())
    except BaseException:
        _close_all(sinks, failed=True)  # (the opening error is the one raised)
        raise
    return sinks


def _close_all(sinks: list[MetricSink], failed: bool) -> list[tuple[MetricSink, Exception]]:
    """Close every sink (one failing does not keep the others open); the sinks that raised."""
    errors = []
    for sink in sinks:
        try:
            sink.close(failed)
        except Exception as e:
            errors.append((sink, e))
    return errors


def step_scalars(
    result: StepResult, throughput: Throughput, moe: Mapping[str, Mapping[str, Any]] | None
) -> dict[str, float]:
    """A log step's scalars, named as in ``metrics.jsonl`` where it has them: loss, lr, grad_norm,
    step_time_s, tokens_per_s, mfu, model_state_mb, peak_memory_mb; per mesh dim
    ``comm_payload_bytes/<dim>`` and ``comm_wire_bytes/<dim>``; per MoE layer
    ``moe_load/<layer>`` (max / mean assignments per expert). Unknown ones (no norm, no device
    peak FLOP/s, the model state before it is measured, no device memory counter on the CPU) are
    left out."""
    r, dt = result, result.step_time_s
    values: dict[str, Any] = {
        "loss": r.loss_value,
        "lr": r.lr,
        "grad_norm": r.grad_norm_value,
        "step_time_s": dt,
        "tokens_per_s": throughput.tokens_per_s(dt),
        "mfu": throughput.mfu(dt),
        "model_state_mb": r.model_state_mb or None,  # (0: not measured yet, the first step)
        "peak_memory_mb": r.peak_memory_mb,
    }
    for dim, t in r.traffic_by_dim.items():
        values[f"comm_payload_bytes/{dim}"] = t.payload_bytes
        values[f"comm_wire_bytes/{dim}"] = t.wire_bytes
    for layer, load in (moe or {}).items():
        values[f"moe_load/{layer}"] = moe_imbalance(load)
    return {k: float(v) for k, v in values.items() if v is not None}


class SinkLog(TrainObserver):
    """Rank 0's metric sinks (built there only): opened at the run's start, a step's scalars
    (`step_scalars`) per log step and ``val_loss`` per evaluation, flushed each time; closed at the
    end or, marked failed, when the run fails. A sink whose send or flush raises (a server gone) is
    turned off with one warning line and closed as failed at the end; a close error is a warning
    line: a sink never fails the run. ``say``: the run record's line (above the progress bar).
    ``moe``: the step's MoE load, read once for every observer (`MoELoad`; `RunRecordLog`, before
    this one, reads it on every rank)."""

    def __init__(
        self, run_dir: Path, throughput: Throughput, moe: MoELoad, say: Callable[[str], None]
    ) -> None:
        self.run_dir, self.throughput, self.moe, self.say = run_dir, throughput, moe, say
        self.sinks: list[MetricSink] = []
        self.off: list[MetricSink] = []  # turned off after an error, closed at the end

    def on_run_start(self, info: RunInfo) -> None:
        self.sinks, self.off = open_sinks(info.cfg, self.run_dir, info.start_step), []

    def _send(self, step: int, values: Mapping[str, float]) -> None:
        for sink in list(self.sinks):
            try:
                sink.scalars(step, values)
                sink.flush()
            except Exception as e:
                self.sinks.remove(sink)
                self.off.append(sink)
                self.say(
                    f"fivefold: warning: metric sink {_name(sink)} failed at step {step} "
                    f"({type(e).__name__}: {e}); turned off, training goes on (metrics.jsonl "
                    "keeps every record)"
                )

    def on_step_end(self, result: StepResult) -> None:
        if result.logged and self.sinks:
            values = step_scalars(result, self.throughput, self.moe.moe_load())
            self._send(result.steps_done, values)

    def on_eval(self, result: EvalResult) -> None:
        self._send(result.steps_done, {"val_loss": float(result.val_loss)})

    def _close(self, failed: bool) -> None:
        sinks, off, self.sinks, self.off = self.sinks, self.off, [], []
        for sink, error in _close_all(sinks, failed):
            self.say(
                f"fivefold: warning: metric sink {_name(sink)} did not close "
                f"({type(error).__name__}: {error})"
            )
        _close_all(off, failed=True)  # (their error was said already)

    def on_run_end(self, result: TrainResult) -> None:
        self._close(failed=False)

    def on_run_abort(self, step: int, error: BaseException) -> None:
        self._close(failed=True)  # (the run's own error is the one raised)


def _name(sink: MetricSink) -> str:
    """``MLflowSink`` -> ``mlflow``, as ``logging.sinks`` names it."""
    name = type(sink).__name__
    return name[: -len("Sink")].lower() if name.endswith("Sink") else name
