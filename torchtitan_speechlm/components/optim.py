"""torchtitan's optimizers and LR schedules, with the two things fine-tuning recipes need.

- ``build_speechlm_optimizers``: torchtitan's ``build_optimizers``, then each optimizer's
  parameters split into a decayed group and a group without weight decay
  (``speechlm.weight_decay_exclude``: embeddings, norms and biases by default, as in ESPnet and
  most LM recipes).
- ``build_speechlm_lr_schedulers``: torchtitan's warmup -> stable -> decay schedule, held at its
  floor after ``lr_scheduler.total_steps``; with ``lr_scheduler.warmup_from_zero`` the warmup
  starts at 0 (ESPnet's ``lambda(0) = 0``: step s of W has s / W of the peak, torchtitan's
  (s + 1) / W). torchtitan evaluates the decay curve past its end
  (a cosine rises again, a linear one goes below the floor); here the last value is kept, which
  gives ESPnet's warmup -> cosine -> constant floor (mapping in docs/checkpoints.md).
- The optimizers' ``step`` runs only after the step guard found the loss and gradients finite
  (components/nonfinite.py).
"""

from __future__ import annotations

import fnmatch

from torch import nn

from torchtitan_speechlm.components.nonfinite import StepGuard, guard_optimizers
from torchtitan_speechlm.model.model import canonical_name
from torchtitan_speechlm.utils.upstream import build_lr_schedulers, build_optimizers

EMBEDDING_PREFIXES = ("tok_embeddings.", "head.stream_emb.")


def excluded(name: str, param: nn.Parameter, rules: list[str], tied: bool) -> bool:
    """Whether parameter ``name`` gets no weight decay under ``rules``."""
    for rule in rules:
        if rule == "embeddings":
            if name.startswith(EMBEDDING_PREFIXES) or (tied and name.startswith("head.output.")):
                return True
        elif rule == "norms":
            if param.ndim == 1 and "norm" in name.lower():
                return True
        elif rule == "biases":
            if name.endswith(".bias"):
                return True
        elif fnmatch.fnmatchcase(name, rule):
            return True
    return False


def held_rows(model: nn.Module) -> set[str]:
    """Parameters with rows that must not change (LoRA's text rows, model/lora.py): their
    rows get no gradient, so only weight decay could move them; they get none."""
    held = set()
    if getattr(getattr(model, "tok_embeddings", None), "frozen_rows", None):
        held.add("tok_embeddings.weight")
    if getattr(getattr(model, "head", None), "frozen_rows", None):
        held.add("tok_embeddings.weight" if model.args.tie_embeddings else "head.output.weight")
    return held


def split_weight_decay(model_parts: list[nn.Module], optimizers, rules: list[str]) -> None:
    """Give every optimizer's excluded parameters their own group with weight_decay 0."""
    names = {}
    for model in model_parts:
        tied = bool(getattr(getattr(model, "args", None), "tie_embeddings", False))
        held = held_rows(model)
        for raw, p in model.named_parameters():
            name = canonical_name(raw)
            names[id(p)] = (name, tied, name in held)
    for opt in optimizers:
        groups = []
        for group in opt.param_groups:
            options = {k: v for k, v in group.items() if k != "params"}
            keep, free = [], []
            for p in group["params"]:
                name, tied, held = names.get(id(p), ("", False, False))
                (free if held or excluded(name, p, rules, tied) else keep).append(p)
            groups += [dict(options, params=keep)] if keep else []
            groups += [dict(options, params=free, weight_decay=0.0)] if free else []
        opt.param_groups.clear()
        for group in groups:
            opt.add_param_group(group)


def build_speechlm_optimizers(
    model_parts, optimizer_config, parallel_dims, ft_manager=None, *, guard: StepGuard
):
    """TrainSpec.build_optimizers_fn (``guard``: the run's step guard, given by the spec)."""
    container = build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    rules = _weight_decay_rules(model_parts)
    if rules or any(held_rows(m) for m in model_parts):
        split_weight_decay(model_parts, list(container), rules)
    guard_optimizers(container, model_parts, guard)  # no update from a NaN/Inf step
    return container


def _weight_decay_rules(model_parts) -> list[str]:
    for model in model_parts:
        args = getattr(model, "args", None)
        if args is not None:
            return list(args.weight_decay_exclude)
    return []


def build_speechlm_lr_schedulers(
    optimizers, lr_scheduler_config, training_steps: int, *, guard: StepGuard
):
    """TrainSpec.build_lr_schedulers_fn (``guard``: the run's step guard, given by the spec)."""
    container = build_lr_schedulers(optimizers, lr_scheduler_config, training_steps)
    end = (
        lr_scheduler_config.total_steps
        if lr_scheduler_config.total_steps is not None
        else training_steps
    )
    warmup = min(int(lr_scheduler_config.warmup_steps), end)
    from_zero = bool(getattr(lr_scheduler_config, "warmup_from_zero", False)) and warmup > 0
    for scheduler in container.schedulers:
        lambdas = [_held_after(f, end) for f in scheduler.lr_lambdas]
        if from_zero:
            lambdas = [_warmup_from_zero(f, warmup) for f in lambdas]
        scheduler.lr_lambdas = lambdas
        apply_factors(scheduler)  # the first step's rates again (LambdaLR set them when built)
    guard.schedulers = container  # its step count is the trainer's step, also on resume
    return container


def apply_factors(scheduler) -> None:
    """Set the optimizer's rates to a LambdaLR's factors at its ``last_epoch``."""
    lrs = [base * f(scheduler.last_epoch) for base, f in
           zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]  # fmt: skip
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs


def _warmup_from_zero(lr_lambda, warmup: int):
    def factor(step: int) -> float:
        return step / warmup if step < warmup else lr_lambda(step)

    return factor


def _held_after(lr_lambda, end: int):
    def held(step: int) -> float:
        return lr_lambda(min(step, end))

    return held
