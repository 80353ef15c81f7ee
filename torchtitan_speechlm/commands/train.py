"""`torchtitan train`: parse and check the config once, then run as this rank, as N local
ranks (torch's elastic launcher), or as one process.

Every entry point goes through ``torchtitan_args`` (our config module merged, booleans as
``--section.key true|false``): the console script, ``-m torchtitan_speechlm.train`` under
torchrun, and the demo. The whole config is validated in the launching process, before any rank
starts (so a typo costs a second, not a cluster allocation):
- inside torchrun / SLURM (RANK or SLURM_PROCID set): runs as that rank;
- with `--nproc-per-node N > 1`: starts N local ranks through torch's own elastic launcher;
- otherwise: runs one process.
The device is CUDA + NCCL when a GPU is visible and CPU + gloo otherwise, with no flag.

Train's settings are torchtitan's config (a TOML and ``--section.key`` overrides), not an
``*Args`` dataclass: its entry points are ``train_command(argv)`` (what the console script runs;
``torchtitan prefer`` runs it in a process of its own) and, from Python with ESPnet's API,
``torchtitan_speechlm.TitanTrainer(...).run()`` (python_api/trainer.py, torchtitan's own loop).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import signal
import socket
import sys
from dataclasses import fields, is_dataclass

from torchtitan_speechlm.commands.train_help import USAGE, train_help
from torchtitan_speechlm.components.resume import completed_run_step
from torchtitan_speechlm.config import ConfigError, check_toml
from torchtitan_speechlm.config.override_check import check_override_keys
from torchtitan_speechlm.config.toml_check import check_toml_file
from torchtitan_speechlm.data.index_store import CHECKED_ENV, export_checked_indexes
from torchtitan_speechlm.trainer import lifecycle
from torchtitan_speechlm.trainer.builders import check_data
from torchtitan_speechlm.trainer.faults import exit_on_user_fault
from torchtitan_speechlm.trainer.plan import REGISTERED_VALUES, RunPlan
from torchtitan_speechlm.trainer.preflight import (
    check_dump_folder,
    check_training_data,
    preflight,
)
from torchtitan_speechlm.trainer.run import VERIFIED_ENV, prepare_run
from torchtitan_speechlm.trainer.spec import is_speechlm
from torchtitan_speechlm.trainer.trainer import SpeechLMTrainer
from torchtitan_speechlm.utils import upstream
from torchtitan_speechlm.utils.checkpoint_folders import checkpoint_folder
from torchtitan_speechlm.utils.compat import run_torchtitan_main
from torchtitan_speechlm.utils.progress import Progress

CONFIG_MODULE = "torchtitan_speechlm.config"


def log_rank(job_config, nproc: int) -> int:
    """The rank whose console the launcher shows: 0, or with pipeline parallelism the first
    rank of the last stage, where torchtitan computes and logs the loss."""
    p = job_config.parallelism
    if p.pipeline_parallel_degree <= 1:
        return 0
    return nproc - nproc // p.pipeline_parallel_degree


def _split_launcher_args(args: list[str]) -> tuple[int, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    known, rest = parser.parse_known_args(args)
    if known.nproc_per_node < 1:
        raise SystemExit("torchtitan train: --nproc-per-node must be >= 1")
    return known.nproc_per_node, rest


def config_file(args: list[str]) -> str | None:
    """The ``--job.config_file`` of a command line (either spelling, ``=`` or not), or None."""
    for i, a in enumerate(args):
        key, eq, val = a.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            return val if eq else (args[i + 1] if i + 1 < len(args) else "")
    return None


def with_config_module(args: list[str]) -> list[str]:
    """Make sure torchtitan merges our [speechlm] sections even if the TOML does not say so."""
    if any(
        a.split("=")[0] in ("--job.custom_config_module", "--job.custom-config-module")
        for a in args
    ):
        return args
    return [*args, "--job.custom_config_module", CONFIG_MODULE]


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool_fields(config_cls) -> set[str]:
    out = set()
    for section in fields(config_cls):
        if is_dataclass(section.type):
            out |= {f"{section.name}.{f.name}" for f in fields(section.type) if f.type is bool}
    return out


def normalise_bool_flags(args: list[str]) -> list[str]:
    """`--section.key false` -> tyro's `--section.no_key` (and `true` -> `--section.key`)."""

    manager = upstream.ConfigManager()
    bools = _bool_fields(upstream.config_class_of(manager, args, upstream.job_toml(manager, args)))
    out, i = [], 0
    while i < len(args):
        key, eq, val = args[i].partition("=")
        name = key[2:].replace("-", "_") if key.startswith("--") else ""
        if name in bools:
            if not eq and i + 1 < len(args) and args[i + 1].lower() in _BOOL_WORDS:
                val, i = args[i + 1], i + 1
            if val:
                if val.lower() not in _BOOL_WORDS:
                    raise SystemExit(f"torchtitan train: {key} takes true or false, not {val!r}")
                section, _, field = name.partition(".")
                key = f"--{name}" if _BOOL_WORDS[val.lower()] else f"--{section}.no_{field}"
            out.append(key)
        else:
            out.append(args[i])
        i += 1
    return out


def torchtitan_args(args: list[str]) -> list[str]:
    """The one parser path of every entry point (``torchtitan train``, ``-m
    torchtitan_speechlm.train`` under torchrun, the demo): our config module merged, and
    ``--section.flag true|false`` turned into tyro's form."""
    return normalise_bool_flags(with_config_module(args))


def import_extensions(args: list[str], toml_values: dict | None) -> None:
    """Import ``experimental.custom_import`` here too, as torchtitan does in every rank, so the
    codecs, patterns, tasks, backbones and specs it registers are known to the checks below."""
    name = (toml_values or {}).get("experimental", {}).get("custom_import", "")
    for i, a in enumerate(args):
        key, eq, val = a.partition("=")
        if key in ("--experimental.custom_import", "--experimental.custom-import"):
            name = val if eq else (args[i + 1] if i + 1 < len(args) else "")
    if name:
        importlib.import_module(name)


def check_config(args: list[str], external=None):
    """Parse and validate exactly as the ranks will; raises ConfigError / FileNotFoundError.
    ``external``: a Python data object (data/external.py) to train on instead of
    ``[speechlm_data]`` (the Python API's EspnetData). Returns the job config."""
    return checked_config(args, external)[0]


def checked_config(args: list[str], external=None) -> tuple[object, RunPlan | None]:
    """``check_config``'s job config and its run plan (None for a job of another spec)."""
    job_config = parse_job(args)
    return job_config, check_job(job_config, external)


def parse_job(args: list[str]):
    """The job config as the ranks will parse it (the TOML's keys checked), before anything
    on disk is read: the launcher takes the dump folder's lock with it (``train_command``)."""

    manager = upstream.ConfigManager()
    toml_values = upstream.job_toml(manager, args)
    import_extensions(args, toml_values)
    config_cls = upstream.config_class_of(manager, args, toml_values)
    if toml_values is not None:
        path = next(
            (
                args[i + 1]
                for i, a in enumerate(args[:-1])
                if a in ("--job.config_file", "--job.config-file")
            ),
            "config",
        )
        check_toml(toml_values, config_cls, source=path, registered=REGISTERED_VALUES)
    check_override_keys(args, config_cls)
    try:
        return manager.parse_args(args)
    except SystemExit as e:  # tyro already printed what is wrong with the command line
        raise ConfigError("invalid command-line override (see above)") from e


def check_job(job_config, external=None) -> RunPlan | None:
    """Every check of a SpeechLM job against what is on disk (its checkpoints, its data), as
    the ranks will make them; its run plan (None for a job of another spec)."""
    if not is_speechlm(job_config):
        return None
    plan, _, _ = prepare_run(job_config, external)
    check_data(job_config, plan)
    check_training_data(job_config, plan)
    export_checked_indexes()  # the ranks skip the stat of every shard file done here
    return plan


def already_complete(job_config) -> str | None:
    """A message if the dump folder already holds the run's last step, else None."""
    step = completed_run_step(job_config)
    if step is None:
        return None
    dump = job_config.job.dump_folder
    return (
        f"the run in {dump} is already complete: {checkpoint_folder(job_config)}/step-{step} "
        f"is at or past training.steps = {job_config.training.steps}, so there is nothing to "
        f"train. To continue it, raise --training.steps; to start over, delete {dump} (or "
        "set another job.dump_folder)"
    )


def set_single_process_env() -> None:
    """This process becomes rank 0 of a world of 1 (torchtitan reads the torchrun variables)."""
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )


def _world_size(nproc: int) -> int:
    """The ranks the job will have: torchrun's / SLURM's when inside one, else ``nproc``."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if key in os.environ:
            return int(os.environ[key])
    return nproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _adopt_slurm_env() -> None:
    """srun without torchrun: map SLURM's variables to torch.distributed's."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise SystemExit(
            "torchtitan train under SLURM needs MASTER_ADDR and MASTER_PORT (e.g. "
            "MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1))"
        )
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")


def train_command(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):  # called without cli.py (the Python API)
        print(train_help())
        return 0
    if "--help-all" in args:
        print(f"{USAGE}\n")
        try:  # torchtitan's own option list, with our [speechlm] sections merged in
            upstream.ConfigManager().parse_args(with_config_module(["--help"]))
        except SystemExit:
            pass
        return 0
    nproc, args = _split_launcher_args(args)
    if not config_file(args):  # torchtitan would run its own default job (llama3, ./assets)
        print(
            "torchtitan train: config error: --job.config_file is required: a training TOML "
            "(e.g. `torchtitan train --job.config_file train_configs/speechlm_debug.toml`, the "
            "demo's; `torchtitan train --help` lists our keys, `--help-all` every key)",
            file=sys.stderr,
        )
        return 2
    try:  # a TOML that is not UTF-8 or not TOML: its file and line, before torchtitan reads it
        check_toml_file(args)
    except ConfigError as e:
        print(f"torchtitan train: config error: {e}", file=sys.stderr)
        return 2
    args = torchtitan_args(args)
    if "RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        os.environ.pop(VERIFIED_ENV, None)  # the launcher sums every file of what it loads
        os.environ.pop(CHECKED_ENV, None)  # and stats every shard file of its datasets
    launcher = "RANK" not in os.environ and "SLURM_PROCID" not in os.environ
    made = False
    try:
        try:
            job_config = parse_job(args)
            parsed = copy.deepcopy(job_config)  # what the rank of this process runs (fix 21)
            if launcher and is_speechlm(job_config):
                # one run per dump folder (trainer/lifecycle.py; the ranks hold it too), taken
                # before any check reads the folder: a second run on a live folder is refused
                # at once, not after summing the live run's checkpoints and shards
                check_dump_folder(job_config)  # writable (a probe file): nothing read
                made = lifecycle.hold_run_folder(job_config.job.dump_folder)
                lifecycle.forget_stop(job_config.job.dump_folder)
            # every dataset's shards and the checkpoint to resume from: seconds on a large run
            with Progress("torchtitan train") as checking:
                checking.status = "checking the config, the datasets and the checkpoints"
                plan = check_job(job_config)
                if plan is not None:
                    preflight(job_config, plan, _world_size(nproc))
        except lifecycle.RunFolderBusy as e:
            print(f"torchtitan train: {e}", file=sys.stderr)
            return 2
        except (ConfigError, FileNotFoundError, ValueError) as e:
            if made:  # the folder this run would have made: not left behind
                lifecycle.leave_new_folder(job_config.job.dump_folder)
            print(f"torchtitan train: config error: {e}", file=sys.stderr)
            return 2
        done = already_complete(job_config)
        if done:
            print(f"torchtitan train: {done}", file=sys.stderr)
            return 0
        return _launch(args, job_config, nproc, parsed)
    finally:
        lifecycle.release()  # an in-process call (a test, the demo) lets the folder go


def _launch(args: list[str], job_config, nproc: int, parsed=None) -> int:
    """Run as this rank, as one process, or as ``nproc`` local ranks (torch's elastic agent).
    ``parsed``: ``args`` parsed (before any check), for a rank run in this process."""
    _adopt_slurm_env()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", "0")
        return run_worker(args, parsed)
    if nproc == 1:
        set_single_process_env()
        return run_worker(args, parsed)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("LOG_RANK", str(log_rank(job_config, nproc)))
    launch = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--local-ranks-filter={os.environ['LOG_RANK']}",
            "--role=rank",
            "--tee=3",
            "-m",
            "torchtitan_speechlm.train",
            *args,
        ]
    )
    lifecycle.quiet_agent_signal_warning()  # the stop line below says it, with the step
    try:
        run(launch)
    except SignalException as e:  # Ctrl-C / SIGTERM: the ranks ended at once, quietly
        dump = job_config.job.dump_folder
        ckpt = checkpoint_folder(job_config) if job_config.checkpoint.enable else None
        line = lifecycle.stop_line(e.sigval, lifecycle.stopped_step(dump), ckpt)
        print(f"torchtitan train: {line}", file=sys.stderr)
        return 128 + int(e.sigval)
    except Exception as e:  # the failing rank already printed why (trainer/faults.py)
        ckpt = checkpoint_folder(job_config) if job_config.checkpoint.enable else None
        print(f"torchtitan train: {describe_rank_failures(e)}; {lifecycle.resume_hint(ckpt)}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def describe_rank_failures(exc: BaseException) -> str:
    """'rank 1 was killed by SIGKILL; rank 0 exited with status 1' from torch's ChildFailedError."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return f"{type(exc).__name__}: a rank failed (see its log above)"
    parts = []
    for rank, failure in sorted(failures.items()):
        code = getattr(failure, "exitcode", None)
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        parts.append(f"rank {rank} {how}")
    return "; ".join(parts) + " (each rank's own message is above)"


def run_worker(args: list[str], job_config=None) -> int:
    """One training rank: torchtitan's own ``main(SpeechLMTrainer)`` after our device selection
    (``job_config``: ``args`` as this process parsed them already, which ``main`` then takes
    instead of parsing them again: compat fix 21).

    A fault the user can act on (a config or data error, a non-finite step under
    ``stop``, a failed checkpoint save, a hung or dead peer) ends the rank with one line naming
    the rank and the fix instead of a traceback (trainer/faults.py decides which)."""
    lifecycle.die_with_launcher()
    restore = lifecycle.stop_on_signals()  # Ctrl-C / SIGTERM: one line, no traceback
    try:
        with exit_on_user_fault():
            # idempotent on already normalised args
            run_torchtitan_main(torchtitan_args(args), SpeechLMTrainer, job_config)
    finally:
        restore()
    return 0
