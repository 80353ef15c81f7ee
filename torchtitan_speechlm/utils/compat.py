"""Every workaround for a torchtitan 0.2.2 / torch limitation lives here, and only here.

Each fix names the upstream code it works around and has its upstream form under ``patches/``
with the same number (``patches/000N-*.diff``; patches/README.md has the table and the PR
texts). ``TORCHTITAN_SPEECHLM_WORKAROUNDS=off`` (read here and nowhere else) switches fixes 1-8,
10-19, 21 and 23 off, so that a torchtitan with the diffs applied can be shown to need none of
them (``patches/check_sufficiency.py``, ``make patches-check``); the default is ``on``.

torchtitan 0.2.2 assumes an accelerator. To train (and test) on a laptop or CI CPU with the gloo
backend, four small, idempotent fixes:

1. ``torchtitan/tools/utils.py::get_device_info`` caches ``_get_available_device_type() or "cuda"``
   at import time, so with no accelerator every module binds ``device_type = "cuda"``.
   -> ``use_cpu_when_no_accelerator()`` makes torch report "cpu" *before* torchtitan is imported.
   (patches/0001-cpu-device-fallback.diff)
2. ``torchtitan/components/metrics.py::DeviceMemoryMonitor`` calls ``torch.cpu.get_device_name``
   and ``memory_stats``, which do not exist. -> a ``CPUMemoryMonitor`` reporting process RSS.
   (patches/0002-cpu-memory-monitor.diff)
3. gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP2 uses for reduce-scatter when a gradient divide
   factor is set (torchtitan's ``disable_fsdp_gradient_division`` sets it to 1.0).
   -> ``force_sum_reduction_on_cpu(model)`` switches FSDP modules to plain SUM. Exact, because the
   factor is 1.0. (patches/0003-gloo-fsdp-sum-reduction.diff)
4. ``torchtitan/distributed/utils.py::set_pg_timeouts`` calls ``barrier(device_ids=[...])``,
   which gloo rejects. -> a plain barrier on CPU. (patches/0004-gloo-barrier.diff)

Four more, not about CPUs:

5. ``torchtitan/config/manager.py::ConfigManager.parse_args(args=sys.argv[1:])`` binds its default
   when the module is imported, so a console script with subcommands (``torchtitan train ...``)
   cannot hand ``torchtitan.train.main`` its arguments. -> ``run_torchtitan_main(args)`` gives
   ``parse_args`` that default for this call. (patches/0005-parse-args-default.diff)

6. ``torchtitan/train.py::Trainer.train_step`` accumulates micro-batch gradients without
   telling DDP (``replicate``) which backward is the last, so every backward all-reduces the
   *accumulated* ``.grad``; with SUM reduction (fix 7, ``sum_gradients_in_ddp``) earlier
   micro-batches are then counted once per rank (a wrong gradient with
   DDP + ``global_batch_size`` > local x dp). -> ``sync_gradients_on_last_microbatch`` toggles
   gradient sync from a forward pre-hook that counts training micro-batches; for HSDP it also
   defers FSDP2's replica all-reduce to the last micro-batch (less traffic, same result).
   (patches/0006-ddp-grad-accumulation-sync.diff)

7. ``torchtitan/models/llama3/infra/parallelize.py::apply_ddp`` keeps DDP's default *mean*
   all-reduce, but the train step backpropagates ``local loss sum / global loss count``, so DDP
   gradients (and grad_norm, clipping) are 1/world_size too small (proposed upstream fix:
   pytorch/torchtitan PR #2323). -> ``sum_gradients_in_ddp`` registers a SUM comm hook.
   (patches/0007-ddp-sum-gradients.diff)

8. ``torchtitan/components/checkpoint.py::CheckpointManager._purge_stale_checkpoints`` counts
   every ``step-N`` folder toward ``keep_latest_k``, also half-written ones (a save killed
   mid-write, an async save in flight), so it could delete the last *complete* checkpoint while
   no newer one was complete. ``dcp_save`` writes into a folder that may still hold an older
   ``.metadata`` (a resave after a resume from an earlier step), so a crash mid-write left an old
   index over new data. -> ``install_checkpoint_safety`` purges among complete checkpoints only
   (plus half-written folders older than the newest complete one) and removes a stale
   ``.metadata`` before the ranks write. (patches/0008-checkpoint-purge-complete-only.diff)
   Not a workaround, and kept with the switch off: a failed save (a full disk, a dead peer)
   becomes ``CheckpointSaveError`` naming the folder, the error and the intact checkpoint a
   rerun resumes from, instead of DCP's multi-rank traceback (our message, not upstream's bug);
   a save that filled the disk without an errno (torch's zip writer: "unexpected pos") says so.
   Also kept with the switch off, our feature rather than a workaround: each checkpoint's
   manifest (utils/checkpoint_manifest.py: ``.manifest.pending`` before the ranks write, every
   file's size and CRC-32C summed as DCP writes it, ``.manifest.json`` after the save).

One of torch, not torchtitan:

9. After a finished multi-process gloo run, interpreter teardown occasionally aborted a rank
   ("terminate called without an active exception": a gloo thread still joinable when its C++
   owner is destroyed; 1-2 in 5 MoE runs), turning a completed run into a failure.
   -> ``leave_without_teardown()``: everything is saved and the process group destroyed, so the
   rank leaves with ``os._exit``. No torchtitan diff can fix torch's teardown, and the root
   cause in torch is not isolated: patches/0009-gloo-teardown-abort.md is the upstream report
   (what is seen, how often, what would reproduce it). Kept with the switch off.

Three more of torchtitan's, for pipelines and for mixture-of-experts layers on a CPU:

10. ``torchtitan/train.py::Trainer.forward_backward_step``'s pipeline branch lets the schedule
   backpropagate each microbatch's loss *sum* and divides by ``global_valid_tokens`` only after
   ``pp_schedule.step`` (for the logged loss), so pipeline-parallel gradients (and grad_norm,
   clipping) are ``global_valid_tokens`` times the non-pipeline ones (pytorch/torchtitan issue
   #2972; main passes the count to the loss, per #2937 and #4194). -> ``pipeline_stage_loss`` returns
   a tensor whose value is the loss sum (what torchtitan adds up and divides) and whose gradient is
   that of ``sum / global_valid_tokens``. (patches/0010-pipeline-loss-normalised-before-backward.diff)

11. ``torchtitan/models/moe/moe.py`` counts the tokens of each expert with ``torch.histc`` on the
    router's int64 expert indices (``TokenChoiceTopKRouter.forward``, ``TokenReorderer.forward``),
    which torch implements for CUDA only ("histogram_cpu" not implemented for 'Long'), so
    torchtitan's MoE (the qwen3 backbone's MoE layers) cannot run on a CPU.
    -> ``count_integers_with_histc_on_cpu()`` lets ``torch.histc`` count integer CPU tensors as
    float32 (exact below 2**24 per bin) and return the counts in the input's dtype, as CUDA's
    does; every other call is torch's own.
    (patches/0011-moe-histc-on-cpu.diff)

12. ``torchtitan/models/moe/utils.py::_permute`` (expert parallelism's token dispatch,
    ``ExpertParallel._token_dispatch``) calls ``generate_permute_indices`` without its
    ``use_cpu`` flag, so the permutation always runs torchtitan's Triton kernel, which has no CPU
    driver: expert parallelism cannot run on CPU ranks. -> ``permute_tokens_on_cpu()`` passes
    ``use_cpu=True`` for CPU tensors (torchtitan's own ``fill_indices_cpu``).
    (patches/0012-moe-permute-on-cpu.diff)

Two of what a run logs, which a user reads first:

13. ``torchtitan/tools/utils.py::get_peak_flops`` runs ``lspci`` and, on a CPU, warns twice
    (``Error running lspci``, ``Peak flops undefined for: cpu, fallback to A100``, once from
    ``train.py``'s Trainer and once from ``components/metrics.py``'s MetricsProcessor), then
    every step line shows ``mfu: 0.00%`` against an A100's peak. -> ``quiet_peak_flops_on_cpu()``
    gives a CPU no peak (no ``lspci``, no warnings) and drops the MFU line, the step line's
    ``mfu`` and the ``mfu(%)`` metric on a CPU (``without_mfu_on_cpu`` wraps the metric loggers).
    (patches/0013-no-peak-flops-on-cpu.diff)

14. ``torchtitan/train.py::Trainer.__init__`` logs ``Building NAME FLAVORwith {...}``: every
    model argument as indented JSON at INFO, about 170 lines for a SpeechLM (the backbone's
    config.json, the vocabulary's 64 reserved tokens) in every training log.
    -> ``summarise_model_args(describe)`` turns that record into one line (``describe`` of the
    arguments) and logs the JSON at DEBUG. (patches/0014-model-args-at-debug.diff)

Two seams torchtitan 0.2.2 lacks, for a trainer that owns its run (trainer/trainer.py):

15. ``torchtitan/train.py::Trainer.__init__`` reads its TrainSpec from the process-wide registry
    (``get_train_spec(job_config.model.name)``), so a subclass cannot hand it a spec of its own:
    our builders need the run the trainer resolved (its plan and training state;
    trainer/builders.py ``RunBuilders``). -> ``init_trainer(init, job_config, train_spec)`` runs
    ``Trainer.__init__`` with the registry answering ``train_spec`` for the job's model name, for
    that call only. (patches/0015-trainer-train-spec-argument.diff: a ``train_spec`` argument.)

16. ``torchtitan/components/checkpoint.py::CheckpointManager`` saves only on its interval or the
    last step (``_should_save``), so a run asked to stop (``SAVE_AND_STOP``: a preemption) or the
    Python API's ``train()`` chunks cannot checkpoint the step they stop at.
    -> ``save_checkpoint_now(checkpointer, step, last_step)`` saves it in full unless the loop's
    own save of this step did, reading ``_should_save`` and setting ``interval`` to 1 for that
    one save. (patches/0016-checkpoint-save-now.diff: ``CheckpointManager.save_now``.)

The switch turns 15 and 16 off too: the code then calls the public forms the diffs add.

One of the loop's end, paid by every run:

17. ``torchtitan/train.py::Trainer.train`` ends with rank 0 logging "Sleeping 2 seconds for other
    ranks to complete" and sleeping 2 s, while the other ranks wait for nothing: every run, one
    process included, ends 2 s late (the Python API's ``train()`` chunks, each a call of it, pay
    it per chunk), and nothing makes sure the other ranks did complete.
    -> ``end_train_on_a_barrier()``, around our ``Trainer.train``: torchtitan's loop runs without
    that sleep (its module's ``time`` has no ``sleep`` for that call, and the line is not logged),
    then every rank of a multi-rank run meets at a barrier before any goes on to close.
    (patches/0017-train-ends-on-a-barrier.diff)

One of every process's start:

18. ``torchtitan/hf_datasets/text_datasets.py`` imports Hugging Face ``datasets`` (with pandas
    and pyarrow) at module level, and ``torchtitan/components/validate.py`` and every model
    package's ``__init__`` import that module, so every process that imports torchtitan's
    trainer pays about 0.5-0.8 s (2 CPU cores) for a library only torchtitan's own text datasets
    (c4) use: each rank, each `torchtitan` command. -> ``defer_hf_text_datasets()`` (before
    torchtitan's code runs) defers that module's code to the first use of one of its names
    (utils/import_hooks.py ``run_on_first_use``); torchtitan's text dataloaders, called, load it
    and work as before. (patches/0018-hf-datasets-imported-on-use.diff: the module imports
    ``datasets`` where it loads one.)

19. ``torchtitan/models/attention.py`` compiles flex and varlen attention when it is imported
    (class attributes ``torch.compile(flex_attention, options=...)`` and
    ``torch.compile(varlen_attn, mode=...)``), and those options import inductor's compiler,
    about 1.1 s of every process that imports torchtitan's trainer, on a CPU where neither runs
    (torch's flex attention has no CPU backward; varlen is CUDA's). -> on a machine without an
    accelerator, ``defer_attention_compiles_on_cpu()`` makes that module's three calls (flex,
    varlen, ``create_block_mask``) return stand-ins that call ``torch.compile`` with the same arguments at their first call;
    with an accelerator nothing changes. (patches/0019-attention-compiled-on-first-use.diff)

One of wandb's, not torchtitan's, paid by every run that logs to wandb:

20. ``wandb/sdk/wandb_run.py::Run._on_ready`` (wandb 0.31; every ``wandb.init``, torchtitan's
    ``WandBLogger`` included) calls ``_detect_and_apply_job_inputs``, which imports
    ``wandb.sdk.launch.inputs.internal`` to apply the job inputs a W&B Launch job staged; that
    import loads wandb's launch agent and public API (about 1.6 s on 2 CPU cores), and inputs
    can only have been staged by code that imported that module already (``wandb.sdk.launch``'s
    ``manage_config_file`` / ``manage_wandb_config``). -> ``start_wandb_without_its_launch_agent()``
    applies staged inputs only when that module is loaded: the same inputs applied, the import
    not paid for nothing. It is installed right after torchtitan is imported
    (``start_every_wandb_run_without_its_launch_agent``), so a run the user's own script starts
    (ESPnet's ``bin/train.py``, the Python API's caller) gets it as torchtitan's logger's does.
    Kept with the switch off (not a torchtitan fix). patches/0020-wandb-launch-inputs-on-use.md
    is the upstream report, with the diff to wandb.

One more of every run's start, torchtitan's:

21. ``torchtitan/train.py::main`` parses the command line itself (``ConfigManager().parse_args()``)
    and takes no config, so a launcher that parsed and checked the same arguments first (ours:
    ``commands/train.py`` ``parse_job``, before it takes the dump folder and checks the data and
    the checkpoints) cannot hand the rank it runs in its own process the result: the TOML is
    read and tyro run again, about 0.25-0.55 s on 2 cores (tyro clears its caches after each
    parse). -> ``run_torchtitan_main(args, trainer_class, job_config)``: for that call,
    ``ConfigManager.parse_args`` of exactly ``args`` returns the launcher's config (a copy taken
    before its checks); ranks started by torchrun parse as before.
    (patches/0021-main-takes-a-parsed-config.diff: ``main(trainer_class, config=None)``.)

One of transformers', not torchtitan's, paid by every process that imports transformers' model
code (each rank, each `torchtitan` command but ``prepare``):

22. ``transformers/loss/loss_utils.py`` (transformers 5.25; imported by ``modeling_utils``)
    imports the DETR-family detection losses, and six of them (``loss_for_object_detection.py``,
    ``loss_deformable_detr.py``, ``loss_rt_detr.py``, ...) import ``scipy.optimize`` at module
    level for ``linear_sum_assignment``: about 0.3 s of one core for scipy's optimisers, which
    only object-detection training calls. -> ``defer_scipy_optimize()`` (``__init__.py``, just
    before ``transformers.loss.loss_utils`` runs) defers ``scipy.optimize``'s code to its first
    use (utils/import_hooks.py ``run_on_first_use``): ``linear_sum_assignment`` is a stand-in
    that loads it and calls the real function, and any other name loads it. Kept with the switch
    off (not a torchtitan fix). patches/0022-transformers-scipy-optimize-on-use.md is the
    upstream report, with the diff to transformers.

One more of CPU training, torchtitan's:

23. ``torchtitan/train.py::Trainer.__init__`` leaves the CPU's floating-point mode as the process
    started: x86 computes denormal floats (below 1.2e-38) in microcode, about 60 times slower
    (a 2048 x 1024 x 256 sgemm with 30% denormal inputs: 3 GFLOPS instead of 200 on 2 cores).
    Softmax probabilities and their gradients underflow into them as a model grows confident, so
    a long CPU run slows down as it learns: the speaker-prompt benchmark's training, 4,700
    tokens/s at its start, ran at 1,650 tokens/s resumed from its step-3,200 checkpoint, and at
    3,100 resumed from the same checkpoint with denormals flushed.
    -> ``flush_denormals_on_cpu()`` (``SpeechLMTrainer.__init__``, first; on a machine without
    an accelerator) sets FTZ/DAZ (``torch.set_flush_denormal``) in this thread, and so in the
    OpenMP threads started after it, which inherit it (threads started before keep their mode:
    the trainer logs which it is, ``denormals_flushed``).
    (patches/0023-cpu-flush-denormals.diff)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import resource
import sys
import time
from collections import namedtuple
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from torchtitan_speechlm.utils import import_hooks, upstream
from torchtitan_speechlm.utils.checkpoint_folders import complete_checkpoints
from torchtitan_speechlm.utils.checkpoint_manifest import (
    install_stream_sums,
    mark_pending,
    write_manifest,
)
from torchtitan_speechlm.utils.collective_errors import is_collective_failure

SWITCH = "TORCHTITAN_SPEECHLM_WORKAROUNDS"


def workarounds_on() -> bool:
    """Fixes 1-8, 10-19, 21 and 23 apply unless ``TORCHTITAN_SPEECHLM_WORKAROUNDS=off`` (a
    torchtitan with the patches/ diffs applied needs none of them)."""
    value = os.environ.get(SWITCH, "on").strip().lower()
    if value not in ("on", "off"):
        raise RuntimeError(f"{SWITCH}={value!r}: expected 'on' (the default) or 'off'")
    return value == "on"


LAUNCH_INPUTS = "wandb.sdk.launch.inputs.internal"  # fix 20: the module that stages them


def start_wandb_without_its_launch_agent() -> None:
    """Fix 20: wandb's ``Run._detect_and_apply_job_inputs`` returns at once unless
    ``wandb.sdk.launch.inputs.internal`` is loaded (the only code that stages launch inputs is
    in it), instead of importing it (and wandb's launch agent) to find none. Idempotent; nothing
    happens where wandb is not installed or has no such method."""
    try:
        from wandb.sdk import wandb_run
    except ImportError:
        return
    original = getattr(wandb_run.Run, "_detect_and_apply_job_inputs", None)
    if original is None or getattr(original, "applies_only_staged_inputs", False):
        return

    def _detect_and_apply_job_inputs(self) -> None:
        if LAUNCH_INPUTS in sys.modules:  # only its functions stage inputs: apply them
            original(self)

    _detect_and_apply_job_inputs.applies_only_staged_inputs = True
    wandb_run.Run._detect_and_apply_job_inputs = _detect_and_apply_job_inputs


def start_every_wandb_run_without_its_launch_agent() -> None:
    """Fix 20 for every ``wandb.init`` of the process, not only torchtitan's logger's: the one a
    user's script calls itself (ESPnet's ``bin/train.py`` calls it before it builds
    ``TitanTrainer``, the Python API logs into the caller's run) is wrapped too, at once where
    wandb's run module is loaded, else when it first is (wandb not imported for it)."""
    import_hooks.around_import(
        "wandb.sdk.wandb_run", lambda: None, start_wandb_without_its_launch_agent
    )


def flush_denormals_on_cpu() -> None:
    """Fix 23 (idempotent): without an accelerator, denormal floats are flushed to zero in this
    thread and in torch's CPU threads started after it."""
    if workarounds_on() and not accelerator_available():
        torch.set_flush_denormal(True)


def denormals_flushed() -> bool:
    """Whether this thread and torch's CPU threads flush denormal floats to zero: 1e-37 / 100 (a
    denormal) on 2**20 elements, which torch splits across its threads."""
    return bool((torch.full((1 << 20,), 1e-37) / 100 == 0).all())


def accelerator_available() -> bool:
    """True when CUDA (or another torch accelerator) is usable in this process."""
    return torch.cuda.is_available()


# fix 18: torchtitan's text datasets module, and the functions other torchtitan modules import
# from it by name when they are imported (components/validate.py, models/*/__init__.py)
HF_TEXT_DATASETS = "torchtitan.hf_datasets.text_datasets"
HF_TEXT_DATASETS_IMPORTED = ("build_text_dataloader", "build_text_validation_dataloader")


def defer_hf_text_datasets() -> None:
    """Fix 18: must run before torchtitan's trainer modules are imported. Their import of
    torchtitan's text datasets module (and with it Hugging Face ``datasets``, pandas, pyarrow)
    waits until one of its names is used: a run of torchtitan's own llama3 on c4 loads it at its
    dataloader's build; a SpeechLM run never does."""
    if workarounds_on():
        import_hooks.run_on_first_use(HF_TEXT_DATASETS, HF_TEXT_DATASETS_IMPORTED)


# fix 22: the scipy module transformers' detection losses import at module level, and the one
# name they import from it
SCIPY_OPTIMIZE = "scipy.optimize"
SCIPY_OPTIMIZE_IMPORTED = ("linear_sum_assignment",)


def defer_scipy_optimize() -> None:
    """Fix 22 (transformers', kept with the switch off): must run before
    ``transformers.loss.loss_utils`` runs. ``scipy.optimize``'s code waits until one of its
    names is used; nothing changes where it is already imported."""
    import_hooks.run_on_first_use(SCIPY_OPTIMIZE, SCIPY_OPTIMIZE_IMPORTED)


# fix 19: the module whose class attributes call torch.compile when it is imported
ATTENTION = "torchtitan.models.attention"


class CompiledOnFirstCall:
    """Fix 19: ``torch.compile(fn, **options)`` done at the first call, then that compiled
    function called; ``torch.compile`` is looked up then, not now."""

    def __init__(self, fn: Callable, options: dict) -> None:
        self.fn, self.options, self.compiled = fn, options, None

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, **self.options)
        return self.compiled(*args, **kwargs)


def defer_attention_compiles_on_cpu() -> None:
    """Fix 19: must run before torchtitan's attention module is imported. Without an
    accelerator, its ``torch.compile`` calls at import (flex attention, varlen attention,
    ``create_block_mask``) return ``CompiledOnFirstCall`` stand-ins; calls from anywhere else are torch's own."""
    if not workarounds_on() or accelerator_available():
        return
    real = torch.compile

    def deferred(model=None, **options):
        caller = sys._getframe(1).f_globals.get("__name__")
        if caller != ATTENTION or model is None:
            return real(model, **options) if model is not None else real(**options)
        return CompiledOnFirstCall(model, options)

    def before() -> None:
        torch.compile = deferred

    def after() -> None:
        torch.compile = real

    import_hooks.around_import(ATTENTION, before, after)


def use_cpu_when_no_accelerator() -> None:
    """Fix 1: must run before the first ``import torchtitan``.

    torch's ``_get_available_device_type`` returns None without an accelerator and torchtitan then
    falls back to "cuda". Returning "cpu" makes torchtitan pick ``torch.cpu`` and gloo.
    """
    import torch._utils as tu

    if not workarounds_on():
        return
    if accelerator_available() or getattr(tu, "_speechlm_cpu_patched", False):
        return
    if "torchtitan.tools.utils" in sys.modules:
        # Too late for this process: torchtitan already cached "cuda". Say so instead of failing
        # later with an obscure CUDA error.
        if upstream.tools_utils.device_type != "cpu":
            raise RuntimeError(
                "torchtitan was imported before torchtitan_speechlm could select the CPU device. "
                "Import torchtitan_speechlm first, or use the `torchtitan train` console script."
            )
    original = tu._get_available_device_type
    tu._get_available_device_type = lambda: original() or "cpu"
    tu._speechlm_cpu_patched = True


DeviceMemStats = namedtuple(
    "DeviceMemStats",
    [
        "max_active_gib",
        "max_active_pct",
        "max_reserved_gib",
        "max_reserved_pct",
        "num_alloc_retries",
        "num_ooms",
    ],
)


class CPUMemoryMonitor:
    """Fix 2: same interface as torchtitan's DeviceMemoryMonitor, reporting peak RSS."""

    device_name = "cpu"

    def __init__(self) -> None:
        try:
            import os

            pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            self.device_capacity = pages * page
        except (ValueError, OSError, AttributeError):
            self.device_capacity = 1
        self.device_capacity_gib = self.device_capacity / 2**30

    @staticmethod
    def peak_rss_bytes() -> int:
        # A lifetime peak (the kernel cannot reset it), in KiB on Linux but in bytes on macOS.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024

    def get_peak_stats(self) -> DeviceMemStats:
        gib = self.peak_rss_bytes() / 2**30
        pct = 100 * self.peak_rss_bytes() / self.device_capacity
        return DeviceMemStats(gib, pct, gib, pct, 0, 0)

    def reset_peak_stats(self) -> None:
        """RSS peak cannot be reset; kept for interface compatibility."""


def install_torchtitan_cpu_patches() -> None:
    """Fixes 2 and 4, applied to the torchtitan modules (idempotent, no-op with an accelerator)."""
    if accelerator_available() or not workarounds_on():
        return
    tt_metrics, tt_dist = upstream.metrics_module, upstream.distributed_utils
    if getattr(tt_dist, "_speechlm_cpu_patched", False):
        return

    def build_cpu_memory_monitor() -> CPUMemoryMonitor:
        return CPUMemoryMonitor()

    def set_pg_timeouts_cpu(timeout: timedelta, parallel_dims) -> None:
        torch.distributed.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()]
        for group in [*groups, None]:
            torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)

    tt_metrics.build_device_memory_monitor = build_cpu_memory_monitor
    tt_dist.set_pg_timeouts = set_pg_timeouts_cpu
    tt_dist._speechlm_cpu_patched = True


def count_integers_with_histc_on_cpu() -> None:
    """Fix 11 (idempotent): ``torch.histc`` of an integer CPU tensor counts it as float32, as
    torchtitan's MoE router needs, in the input's dtype (CUDA and float inputs: torch's own)."""
    if not workarounds_on() or getattr(torch.histc, "_speechlm_cpu_ints", False):
        return
    histc = torch.histc

    def histc_counting_cpu_integers(input, *args, **kwargs):
        if input.device.type == "cpu" and not input.is_floating_point():
            # counted as float32, returned in the input's dtype (what CUDA's histc returns)
            return histc(input.float(), *args, **kwargs).to(input.dtype)
        return histc(input, *args, **kwargs)

    histc_counting_cpu_integers._speechlm_cpu_ints = True
    torch.histc = histc_counting_cpu_integers


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed (e.g. a full disk); the message names the folder and the fix."""


def _save_failure(exc: BaseException) -> tuple[list[int], BaseException]:
    """(failing ranks, first underlying error) of a DCP save exception."""
    failures = getattr(exc, "failures", None)
    if failures:
        ranks = sorted(failures)
        first = failures[ranks[0]]
        return ranks, first[0] if isinstance(first, tuple) else first
    return [dist.get_rank() if dist.is_initialized() else 0], exc


def _disk_full(cause: BaseException, folder: str) -> bool:
    """The save failed for want of space: ENOSPC anywhere in the chain, or torch's zip writer
    stopping short ("unexpected pos 704 vs 598", a RuntimeError without errno) on a disk with
    less than 1 MiB left."""
    import errno
    import shutil

    seen, e = set(), cause
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__ or e.__context__
    text = str(cause)
    if "unexpected pos" in text or "file write failed" in text or "No space left" in text:
        try:
            free = shutil.disk_usage(folder if os.path.isdir(folder) else ".").free
        except OSError:
            return True
        return "No space left" in text or free < 1 << 20
    return False


def install_checkpoint_safety() -> None:
    """Fix 8 and the save-error message (idempotent; on every device)."""
    import shutil

    logger = upstream.logger
    manager = upstream.checkpoint_module.CheckpointManager
    if getattr(manager, "_speechlm_safe", False):
        return
    install_stream_sums()
    original_save = manager.dcp_save
    original_purge = manager._purge_stale_checkpoints

    def is_rank0() -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    fix = workarounds_on()

    def dcp_save(self, state_dict, checkpoint_id, async_mode, *args, **kwargs):
        stale = os.path.join(str(checkpoint_id), ".metadata")
        if fix and is_rank0() and os.path.isfile(stale):
            # before dcp.save's first collective, hence before any rank writes data
            logger.warning(f"{checkpoint_id} already holds a checkpoint: overwriting it")
            os.remove(stale)
        if is_rank0():  # the folder is not intact until its manifest (checkpoint_manifest.py)
            mark_pending(str(checkpoint_id))
        try:
            result = original_save(self, state_dict, checkpoint_id, async_mode, *args, **kwargs)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            ranks, cause = _save_failure(e)
            folder = os.path.dirname(str(checkpoint_id))
            done = complete_checkpoints(folder)
            intact = (
                f"{folder}/step-{done[-1]} is intact and a rerun resumes from it"
                if done
                else "there is no earlier checkpoint, so a rerun starts from step 1"
            )
            reason = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0][:300]}"
            if is_collective_failure(cause):
                reason = f"a peer rank died or hung during the save ({reason})"
            elif _disk_full(cause, folder):
                usage = shutil.disk_usage(folder if os.path.isdir(folder) else ".")
                reason = (
                    f"the disk is full (ENOSPC, {usage.free / 2**30:.2f} GiB free) writing "
                    f"{getattr(cause, 'filename', None) or checkpoint_id}"
                )
            if is_rank0():
                shutil.rmtree(str(checkpoint_id), ignore_errors=True)  # no .metadata: never loaded
            raise CheckpointSaveError(
                f"saving checkpoint {checkpoint_id} failed on rank(s) {ranks}: {reason}. "
                f"Nothing of it is kept (the partial folder was removed); {intact}. Free space "
                "or point job.dump_folder elsewhere, and lower checkpoint.keep_latest_k if disk "
                "space is tight"
            ) from None
        if is_rank0():  # every rank's files and .metadata are written (or will be: async)
            done = getattr(result, "upload_completion", result)
            if hasattr(done, "add_done_callback"):  # an async save: confirmed once written
                done.add_done_callback(
                    lambda f: f.exception() is None and write_manifest(str(checkpoint_id))
                )
            else:
                write_manifest(str(checkpoint_id))
        return result

    def purge(self) -> None:
        if getattr(self, "enable_ft_dataloader_checkpoints", False):
            return original_purge(self)
        if not (self.keep_latest_k > 0 and is_rank0() and os.path.isdir(self.folder)):
            return
        complete = complete_checkpoints(self.folder)
        doomed = set(complete[: -self.keep_latest_k])
        newest = complete[-1] if complete else -1
        for name in os.listdir(self.folder):
            m = re.fullmatch(r"step-(\d+)", name)
            if not m:
                continue
            step = int(m.group(1))
            if step in doomed or (step < newest and step not in complete):
                self.purge_queue.put(os.path.join(self.folder, name))

    manager.dcp_save = dcp_save
    if fix:
        manager._purge_stale_checkpoints = purge
    manager._speechlm_safe = True


def force_sum_reduction_on_cpu(model: torch.nn.Module) -> None:
    """Fix 3: gloo cannot PREMUL_SUM; with divide factor 1.0 a plain SUM is identical."""
    if accelerator_available() or not workarounds_on():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def run_torchtitan_main(args: list[str], trainer_class, job_config=None) -> None:
    """Fix 5: run ``torchtitan.train.main(trainer_class)`` on ``args`` instead of import-time
    argv; fix 21: with ``job_config`` (this process's parse of the same ``args``, which the
    launcher made and checked), ``main`` takes it instead of parsing ``args`` again; then fix 9."""
    ConfigManager, main = upstream.ConfigManager, upstream.train_main
    if not workarounds_on():  # patches/0005: parse_args reads sys.argv when called
        argv = sys.argv
        sys.argv = [argv[0], *args]
        try:  # patches/0021: main takes a parsed config
            main(trainer_class) if job_config is None else main(trainer_class, job_config)
        finally:
            sys.argv = argv
        return leave_without_teardown()
    original = ConfigManager.parse_args
    ours = list(args)

    def parse_args(self, args: list[str] = ours):
        if job_config is not None and list(args) == ours:  # fix 21: parsed already
            self.config = job_config
            return job_config
        return original(self, args)

    ConfigManager.parse_args = parse_args  # fix 5: its default is ``args``
    try:
        main(trainer_class)
    finally:
        ConfigManager.parse_args = original
    leave_without_teardown()


def leave_without_teardown() -> None:
    """Fix 9: a finished multi-process CPU (gloo) rank leaves with ``os._exit(0)``; every file
    is written and the process group destroyed by now (see the module docstring)."""
    if not accelerator_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def sync_gradients_on_last_microbatch(
    model: torch.nn.Module, accumulation_steps: int, ddp: bool, hsdp: bool
) -> None:
    """Fix 6: reduce gradients only in the last micro-batch's backward of each step.

    Must be registered before ``replicate``'s own pre-hook, which reads the flag at forward.
    Only grad-enabled training forwards count (validation runs under no_grad).
    """
    if accumulation_steps <= 1 or not (ddp or hsdp) or not workarounds_on():
        return
    counter = {"n": 0}

    def pre_hook(module: torch.nn.Module, args, kwargs) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        last = counter["n"] % accumulation_steps == accumulation_steps - 1
        counter["n"] += 1
        if ddp:
            module.set_requires_gradient_sync(last)
        else:
            module.set_requires_all_reduce(last, recurse=True)

    model.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)


def _allreduce_sum_hook(group, bucket):
    return (
        dist.all_reduce(bucket.buffer(), group=group, async_op=True)
        .get_future()
        .then(lambda fut: fut.value()[0])
    )


def sum_gradients_in_ddp(model: torch.nn.Module, group) -> None:
    """Fix 7: make DDP all-reduce gradients with SUM instead of its default mean.

    torchtitan's train step backpropagates ``local loss sum / global loss count`` on every rank,
    so the true gradient is the *sum* of the ranks' gradients (that is why torchtitan sets FSDP's
    gradient divide factor to 1). DDP's default hook divides by the world size, which left the
    DDP gradients (and ``grad_norm``, and max_norm clipping) 1/world_size too small; Adam hid it
    in the loss curve. torchtitan 0.2.2's llama3 ``apply_ddp`` has the same issue (upstream
    PR pytorch/torchtitan#2323 proposed the same hook; patches/0007-ddp-sum-gradients.diff).

    DDP accepts one comm hook only, so if ``apply_ddp`` already registered one (a torchtitan with
    the upstream fix), this does nothing.
    """
    from torch.distributed._composable.replicate import replicate

    if not workarounds_on() or getattr(replicate.state(model), "_comm_hook_args", None):
        return
    model.register_comm_hook(group, _allreduce_sum_hook)


def pipeline_stage_loss(loss_sum: torch.Tensor, global_valid_tokens) -> torch.Tensor:
    """Fix 10: what the last pipeline stage hands torchtitan's schedule for one microbatch.

    Its value is ``loss_sum`` (torchtitan sums the schedule's losses and divides by the count
    itself, for the log); its gradient is that of ``loss_sum / global_valid_tokens``, the
    non-pipeline train step's, because the schedule runs backward on it before torchtitan divides.
    """
    if not workarounds_on():
        return loss_sum
    # a tensor, or (torchtitan's ``dist_sum`` over data-parallel ranks) a Python number
    count = torch.as_tensor(global_valid_tokens, dtype=loss_sum.dtype, device=loss_sum.device)
    scaled = loss_sum / count
    return scaled + (loss_sum - scaled).detach()


def permute_tokens_on_cpu() -> None:
    """Fix 12 (idempotent): expert parallelism's token permutation on CPU tensors runs
    torchtitan's CPU implementation instead of its Triton kernel."""
    utils = upstream.moe_utils
    if not workarounds_on() or getattr(utils.generate_permute_indices, "_speechlm_cpu", False):
        return
    original = utils.generate_permute_indices

    def generate_permute_indices(tokens_per_expert_group, *args, **kwargs):
        if tokens_per_expert_group.device.type == "cpu":
            kwargs.setdefault("use_cpu", True)
        return original(tokens_per_expert_group, *args, **kwargs)

    generate_permute_indices._speechlm_cpu = True
    utils.generate_permute_indices = generate_permute_indices


_FINAL_SLEEP = "Sleeping 2 seconds for other ranks"  # torchtitan's Trainer.train, fix 17
_MFU = re.compile(r"\s+(\x1b\[[0-9;]*m)?mfu: \S+%")  # the step line's mfu column


class _RunLogFilter(logging.Filter):
    """Fixes 13, 14 and 17 on the records torchtitan logs through its (root) logger."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu = False  # fix 13: drop the MFU figures
        self.describe: Callable[[dict], str] | None = None  # fix 14: the arguments' summary
        self.no_final_sleep = False  # fix 17: the sleep it announces does not happen

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not isinstance(record.msg, str):
            return True
        msg = record.msg
        if self.no_final_sleep and msg.startswith(_FINAL_SLEEP):
            return False
        if self.cpu and msg.startswith("Peak FLOPS used for computing MFU"):
            return False
        if self.cpu and "mfu: " in msg:
            record.msg = _MFU.sub("", msg)
        head, sep, dump = msg.partition("with {")
        if self.describe is not None and msg.startswith("Building ") and sep:
            try:
                args = json.loads("{" + dump)
            except ValueError:
                return True
            logging.getLogger().debug(f"{head.rstrip()} with {{{dump}")
            record.msg = f"{head.rstrip()}: {self.describe(args)}"
        return True


def _run_log_filter() -> _RunLogFilter:
    root = logging.getLogger()  # torchtitan's logger
    found = next((f for f in root.filters if isinstance(f, _RunLogFilter)), None)
    if found is None:
        found = _RunLogFilter()
        root.addFilter(found)
    return found


def quiet_peak_flops_on_cpu() -> None:
    """Fix 13 (idempotent; CPU only): no peak FLOPS for a CPU, so no ``lspci``, no warnings,
    and no MFU on the console (the metric: ``without_mfu_on_cpu``)."""
    if accelerator_available() or not workarounds_on():
        return
    tt_utils = upstream.tools_utils
    if not getattr(tt_utils.get_peak_flops, "_speechlm_cpu", False):
        original = tt_utils.get_peak_flops

        def get_peak_flops(device_name: str) -> float:
            # inf: torchtitan's MFU division gives 0, which is never shown (_RunLogFilter)
            return float("inf") if device_name == "cpu" else original(device_name)

        get_peak_flops._speechlm_cpu = True
        tt_utils.get_peak_flops = get_peak_flops
    _run_log_filter().cpu = True


class _WithoutMfu:
    """A metrics logger (torchtitan's BaseLogger interface) that drops ``mfu(%)``."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def log(self, metrics: dict, step: int) -> None:
        self.inner.log({k: v for k, v in metrics.items() if k != "mfu(%)"}, step)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def without_mfu_on_cpu(metrics_logger):
    """Fix 13's metric: ``metrics_logger`` without the ``mfu(%)`` key on a CPU (unchanged with
    an accelerator or the switch off)."""
    if accelerator_available() or not workarounds_on():
        return metrics_logger
    return _WithoutMfu(metrics_logger)


def summarise_model_args(describe: Callable[[dict], str]) -> None:
    """Fix 14 (idempotent): torchtitan's ``Building ... with {JSON}`` becomes one line,
    ``describe(model arguments as a dict)``; the JSON goes to DEBUG."""
    if workarounds_on():
        _run_log_filter().describe = describe


def init_trainer(init, job_config, train_spec) -> None:
    """Fix 15: ``init(job_config)`` (torchtitan's ``Trainer.__init__``, bound) with
    ``train_spec`` as the trainer's spec instead of the registered one of the job's model name.
    With the switch off (patches/0015 applied) the spec is torchtitan's ``train_spec`` argument.
    ``train_spec`` None (a job of another spec): torchtitan's own."""
    if train_spec is None:
        return init(job_config)
    if not workarounds_on():
        return init(job_config, train_spec=train_spec)
    registry = upstream.train_spec_module
    registered = registry.get_train_spec
    name = job_config.model.name

    def get_train_spec(asked: str):
        return train_spec if asked == name else registered(asked)

    registry.get_train_spec = get_train_spec  # torchtitan's __init__ reads it once, by name
    try:
        return init(job_config)
    finally:
        registry.get_train_spec = registered


def save_checkpoint_now(checkpointer, step: int, last_step: bool) -> None:
    """Fix 16: save ``step`` in full now, off the checkpoint interval, unless the loop's own
    ``save(step, last_step)`` saved it. With the switch off (patches/0016 applied):
    ``CheckpointManager.save_now``."""
    if not workarounds_on():
        return checkpointer.save_now(step, last_step)
    if not checkpointer.enable or checkpointer._should_save(step, last_step):
        return
    interval = checkpointer.interval
    checkpointer.interval = 1
    try:
        checkpointer.save(step)
    finally:
        checkpointer.interval = interval


# fix 17: torchtitan.train's ``time`` while our trainer's train() runs: time.sleep is only called
# for the 2-second wait at the end of Trainer.train there (every other name is time's own)
_TIME_WITHOUT_SLEEP = SimpleNamespace(
    **{k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
)
_TIME_WITHOUT_SLEEP.sleep = lambda seconds: None


@contextlib.contextmanager
def end_train_on_a_barrier() -> Iterator[None]:
    """Fix 17, around a call of torchtitan's ``Trainer.train``: no 2-second sleep at its end,
    then, once it returned, a barrier of every rank of a multi-rank run (none on one process;
    none when it raised: a failed rank must not wait for the others). With the switch off
    (patches/0017 applied) torchtitan's ``train`` ends on that barrier itself."""
    if not workarounds_on():
        yield
        return
    module = upstream.train_module
    _run_log_filter().no_final_sleep = True
    module.time = _TIME_WITHOUT_SLEEP
    try:
        yield
    finally:
        module.time = time
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
