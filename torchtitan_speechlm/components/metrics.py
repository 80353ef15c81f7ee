"""SpeechLMMetricsProcessor: torchtitan's MetricsProcessor plus exact speech statistics.

Adds ``train/*`` (count-normalised over the whole log interval, see stats.py) to what torchtitan
logs, prints a per-stream line on the console, and defaults wandb to *offline* files under the
dump folder (``WANDB_MODE=online`` opts in). If wandb cannot start, torchtitan's logger factory
logs the error once and training continues with the other loggers.
"""

from __future__ import annotations

import json
import os
import time
from math import nan
from typing import Any

import torch

from torchtitan_speechlm.components.nonfinite import StepGuard
from torchtitan_speechlm.components.samples import TrainingSamples
from torchtitan_speechlm.components.stats import StatsAccumulator, loss_group
from torchtitan_speechlm.utils import compat
from torchtitan_speechlm.utils.upstream import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    get_metrics_rank,
    logger,
)


class JsonlLogger(BaseLogger):
    """Every logged dict as one JSON line (exact floats, easy to grep, plot or test).

    Whole lines only: each line is one ``write`` to the file (no buffer to flush again at
    exit), and a write that fails part-way (a full disk) is cut back to the line before, so
    the file never holds half a line; the OSError goes on (the rank's one-line disk message,
    trainer/faults.py). A file that ends in a torn line anyway (a crash of an older run, a
    copy cut short) is repaired when the run opens it again: the torn tail is removed, with a
    warning, before anything is appended."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        repair_torn_tail(path)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step}
        row.update(
            {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
        )
        append_line(self._fd, json.dumps(row) + "\n", self.path)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def append_line(fd: int, line: str, path: str, write=os.write) -> None:
    """Append ``line`` whole or not at all (a partial write is truncated away); ``write``:
    ``os.write`` (the fault tests' stands in for a disk that fills part-way)."""
    data = line.encode()
    start = os.fstat(fd).st_size
    try:
        done = 0
        while done < len(data):
            done += write(fd, data[done:])
    except OSError as e:
        os.ftruncate(fd, start)
        if e.filename is None:
            e.filename = path
        raise


def repair_torn_tail(path: str) -> None:
    """Cut a file of lines back to its last whole line (warning how much was removed)."""
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            keep, end = 0, size
            while end > 0 and not keep:  # back to the last newline, 64 KiB at a time
                start = max(0, end - (64 << 10))
                f.seek(start)
                chunk = f.read(end - start)
                keep = start + chunk.rfind(b"\n") + 1 if b"\n" in chunk else 0
                end = start
            f.truncate(keep)
    except FileNotFoundError:
        return
    logger.warning(
        f"{path} ended in a torn line ({size - keep} bytes: a write cut short by a full disk "
        "or a crash); removed it before appending"
    )


class SpeechLMMetricsProcessor(MetricsProcessor):
    _audio_flops = 0  # no audio tower (set in __init__ from the model args)
    _audio_clips_per_frame = 0.0

    def __init__(
        self,
        job_config,
        parallel_dims,
        tag: str | None = None,
        *,
        accumulator: StatsAccumulator,
        guard: StepGuard,
        samples: TrainingSamples,
        frame_rate: float,
        num_streams: int,
        model_args=None,
        step_codec=None,
        code_usage_interval: int = 0,
        espnet_keys: bool = False,
    ):
        """``code_usage_interval``: log per-stream code usage at these steps (0: never);
        ``espnet_keys``: also log ESPnet TitanTrainer's keys (``speechlm.code_usage_interval``
        and ``metrics.espnet_keys``, which the builder hands in: no section is read here)."""
        # MFU counts the head only on frames that carry loss (where it runs): see
        # num_flops_per_token below and SpeechLMModelArgs.head_flops_per_loss_frame.
        self._head_flops = (
            model_args.head_flops_per_loss_frame()
            if model_args is not None and model_args.backbone_config
            else 0
        )
        self._loss_frame_ratio = 1.0
        # the audio tower runs per clip: num_flops_per_token adds it x the interval's clips per
        # frame (SpeechLMModelArgs.audio_flops_per_clip; 0 without an encoder)
        self._audio_flops = (
            model_args.audio_flops_per_clip()
            if model_args is not None and model_args.audio_encoder and model_args.backbone_config
            else 0
        )
        self._audio_clips_per_frame = 0.0
        if job_config.metrics.enable_wandb:
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_PROJECT", "torchtitan-speechlm")
            os.environ.setdefault("WANDB_SILENT", "true")
        super().__init__(job_config, parallel_dims, tag)
        self.accumulator, self.guard, self.samples = accumulator, guard, samples
        self.frame_rate, self.num_streams = frame_rate, num_streams
        # the rank torchtitan logs from (a pipeline's: the first rank of the last stage)
        log_rank = get_metrics_rank(parallel_dims, job_config) if parallel_dims else 0
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == log_rank:
            container = LoggerContainer()
            container.add_logger(self.logger)
            container.add_logger(
                JsonlLogger(os.path.join(job_config.job.dump_folder, "metrics.jsonl"))
            )
            self.logger = compat.without_mfu_on_cpu(container)  # no GPU peak to divide by

        self.code_usage_interval, self.espnet_keys = code_usage_interval, espnet_keys
        self.step_codec = step_codec  # its tokenising time is logged (components/step_codec.py)
        self._steps_since_log = 0  # train steps since the last log (should_log: once a step)

    @property
    def num_flops_per_token(self) -> float:
        """FLOPs per frame of the last log interval: the body on every frame, the head on the
        interval's share of loss frames (torchtitan sets the every-frame figure), and the audio
        tower's FLOPs per clip x the interval's clips per frame."""
        if self._flops_every_frame <= 0:
            return self._flops_every_frame
        flops = self._flops_every_frame - self._head_flops * (1.0 - self._loss_frame_ratio)
        if self._audio_flops:
            flops += self._audio_flops * self._audio_clips_per_frame
        return flops

    @num_flops_per_token.setter
    def num_flops_per_token(self, value: float) -> None:
        self._flops_every_frame = value

    def should_log(self, step: int) -> bool:
        """torchtitan's rule; its train step asks once per step, which is counted here."""
        self._steps_since_log += 1
        return super().should_log(step)

    def speech_metrics(self, step: int) -> dict[str, float]:
        """The interval's exact statistics, as logged under train/ (reduces over ranks)."""
        elapsed = max(time.perf_counter() - self.time_last_log, 1e-9)
        stats = self.accumulator.reduce(loss_group(self.parallel_dims))
        every = self.code_usage_interval
        if not (every > 0 and (step % every == 0 or step == 1)):
            stats = {k: v for k, v in stats.items() if not k.startswith("codes/")}
        audio = stats.pop("data/audio_frames_total", 0.0)
        if self.frame_rate > 0:
            stats["throughput/audio_seconds_per_second"] = audio / self.frame_rate / elapsed
        return stats

    def read_interval(self, stats: dict[str, float]) -> None:
        """What num_flops_per_token needs from the interval's statistics (pops the clips per
        frame, which is not logged)."""
        self._loss_frame_ratio = stats.get("data/loss_frame_ratio", 1.0)
        self._audio_clips_per_frame = stats.pop("data/audio_clips_per_frame", 0.0)

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        stats = self.speech_metrics(step)
        self.read_interval(stats)
        extra = dict(extra_metrics or {})
        extra.update(self.guard.metrics())
        steps = max(self._steps_since_log, 1)
        self._steps_since_log = 0
        if self.step_codec is not None:
            extra.update(self.step_codec.interval_metrics(steps))
        if self.espnet_keys:  # ESPnet TitanTrainer's dashboards' keys
            extra["train/lr"] = extra.get("lr", nan)
            extra["train/grad_norm"] = grad_norm
            extra["time/iter"] = (time.perf_counter() - self.time_last_log) / steps
        extra.update(
            {(k if k.startswith("throughput/") else f"train/{k}"): v for k, v in stats.items()}
        )
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra)
        if self.samples.due(step) and self.model_parts:
            self.samples.run(step, self.model_parts, self.logger)
        if "preference_pairs" in stats:  # DPO / SimPO: the pair statistics (docs/preference.md)
            logger.info(preference_line(step, stats, self.color))
        if "loss_frames" in stats:  # not on a pipeline stage before the last (no loss there)
            accs, ces = (
                stream_values(stats, "acc_stream", self.num_streams),
                stream_values(stats, "ce_stream", self.num_streams),
            )
            logger.info(
                f"{self.color.green}step: {step:2}  ce_loss: {stats.get('ce_loss', nan):.4f}  "
                f"z_loss: {stats.get('z_loss', nan):.4f}  ce/stream: [{ces}]  acc/stream: [{accs}]  "
                f"pad: {100 * stats.get('data/padding_ratio', 0):.1f}%  "
                f"audio s/s: {stats.get('throughput/audio_seconds_per_second', 0):.1f}  "
                f"loss_frames: {int(stats['loss_frames'])}{self.color.reset}"
            )


def stream_values(stats: dict[str, float], prefix: str, n: int) -> str:
    """'0.123 - 0.456': a stream with nothing to count (key left out) shows as '-'."""
    return " ".join(
        f"{stats[f'{prefix}{k}']:.3f}" if f"{prefix}{k}" in stats else "-" for k in range(n)
    )


def preference_line(step: int, stats: dict[str, float], color) -> str:
    """The console line of a preference run's log step: the interval's exact means over pairs
    (TRL's names; a key the interval has no value for shows as '-')."""

    def v(key: str, fmt: str = ".4f") -> str:
        return format(stats[key], fmt) if key in stats else "-"

    return (
        f"{color.green}step: {step:2}  preference_loss: {v('preference_loss')}  "
        f"rewards/chosen: {v('rewards/chosen')}  rewards/rejected: {v('rewards/rejected')}  "
        f"rewards/margins: {v('rewards/margins')}  rewards/accuracies: "
        f"{v('rewards/accuracies', '.3f')}  logps/chosen: {v('logps/chosen', '.2f')}  "
        f"logps/rejected: {v('logps/rejected', '.2f')}  nll_loss: {v('nll_loss')}  "
        f"pairs: {int(stats['preference_pairs'])}{color.reset}"
    )
