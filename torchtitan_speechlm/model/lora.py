"""LoRA on a SpeechLM's decoder, with PEFT's own LoRA layers (``peft.inject_adapter_in_model``).

``apply_lora`` wraps the matching ``nn.Linear`` modules of ``model.backbone`` in
``peft.tuners.lora.Linear`` (the frozen layer becomes ``<name>.base_layer``, the adapters
``<name>.lora_A.default`` / ``lora_B.default``) and freezes every other parameter of the LM
(an audio encoder in front keeps its own ``[audio_encoder]`` freeze settings), except, by
the settings, the rows the SpeechLM added to the text vocabulary (special tokens and codebook
codes, in the embedding and the head, and the per-stream head offsets) and the whole head.
The added rows train while the text rows stay exactly as loaded: the embedding and head are
single tensors, so their text rows are held by a gradient mask (``StreamEmbedding.frozen_rows``,
``SpeechLMHead.frozen_rows``) and get weight decay 0 (components/optim.py).

PEFT's layers are plain modules around ``nn.Linear``s, so FSDP2, activation checkpointing,
per-layer compile and DCP see ordinary parameters; tensor parallelism shards the base layers
with torchtitan's plan and the adapters around them (distributed/parallelize.py). The adapters start
as PEFT's do (A: Kaiming-uniform, B: zeros: the model starts as the base model), drawn from
(init_seed, name) like every other parameter so any world size starts identically.

The settings (``LoraSettings``, carried by ``SpeechLMModelArgs.lora``; None: no LoRA) are
recorded with the run, so an export or a reload rebuilds the same modules
(``model.build_model``). ``merge_lora`` folds the
adapters into the base weights (PEFT's ``merge``), giving the plain SpeechLM back.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

CONVERTER = "lora"  # its name in `[model] converters`
ADAPTER = "default"  # PEFT's adapter name (dropped from the keys of a saved PEFT adapter)
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every nn.Linear of the decoder
LORA_PARTS = (".lora_A.", ".lora_B.")
BASE_PART = ".base_layer."
SETTING_KEYS = ("rank", "alpha", "dropout", "target_modules", "train_audio_rows", "train_head")


class LoraError(ValueError):
    """A LoRA setting that cannot apply to this model; the message names the key and the fix."""


def peft_module():
    """``peft``, or an error saying how to install it (an optional extra)."""
    try:
        import peft
    except ImportError:
        raise LoraError(
            'model.converters = ["lora"] needs PEFT: pip install "torchtitan-speechlm[lora]" '
            "(or pip install peft)"
        ) from None
    return peft


def is_lora_param(name: str) -> bool:
    return any(part in name for part in LORA_PARTS)


def base_name(name: str) -> str:
    """A wrapped layer's parameter under its plain name (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``): the name of the same tensor in a model without LoRA."""
    return name.replace(BASE_PART, ".")


def lora_init(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """PEFT's default init of an adapter weight: A Kaiming-uniform (a = sqrt(5), i.e. uniform
    in +-1/sqrt(fan_in)), B zeros, so the wrapped layer starts equal to its base layer."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


def linear_names(backbone: nn.Module) -> list[str]:
    """The decoder's ``nn.Linear`` modules, by name inside the backbone."""
    return [n for n, m in backbone.named_modules() if type(m) is nn.Linear]


def _suffixes(names: list[str]) -> list[str]:
    """``layers.0.self_attn.q_proj`` -> ``self_attn.q_proj``: the names without the layer index,
    in order of first appearance (what an error lists as possible targets)."""
    out: list[str] = []
    for name in names:
        parts = name.split(".")
        cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), 0)
        short = ".".join(parts[cut:])
        if short not in out:
            out.append(short)
    return out


def match_targets(backbone: nn.Module, patterns: list[str]) -> list[str]:
    """The Linear modules ``patterns`` select, PEFT's way: ``all-linear``, or a name that is the
    module's name or its last components (``q_proj``, ``self_attn.q_proj``,
    ``layers.0.mlp.up_proj``). Each pattern must select at least one."""
    linears = linear_names(backbone)
    if not patterns:
        raise LoraError(f'lora.target_modules is empty: name layers, or ["{ALL_LINEAR}"]')
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == ALL_LINEAR:
            hits = linears
        else:
            hits = [n for n in linears if n == pattern or n.endswith("." + pattern)]
        if not hits:
            raise LoraError(
                f"lora.target_modules entry {pattern!r} matches no linear layer of the decoder. "
                f"Its linear layers: {', '.join(_suffixes(linears))} (each in every block, "
                f'e.g. {linears[0] if linears else "none"}); or use "{ALL_LINEAR}"'
            )
        chosen.update(hits)
    return [n for n in linears if n in chosen]


@dataclass(frozen=True)
class LoraSettings:
    """``[lora]`` as the model carries it (``SpeechLMModelArgs.lora``; None: no LoRA). Read
    once, by the run plan (``from_config``: when ``model.converters`` lists ``"lora"``), typed
    and checked once, here, when made (a ``LoraError`` naming the key); recorded with the run
    and its exports (``to_dict``, the keys of ``SETTING_KEYS``) and read back (``from_dict``),
    so the converter, export and generation apply the same value."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    train_audio_rows: bool = True
    train_head: bool = False

    def __post_init__(self) -> None:
        if int(self.rank) < 1:
            raise LoraError(f"lora.rank = {self.rank}: must be >= 1")
        if float(self.alpha) <= 0:
            raise LoraError(f"lora.alpha = {self.alpha}: must be > 0")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise LoraError(f"lora.dropout = {self.dropout}: must be in [0, 1)")
        for key, kind in (("rank", int), ("alpha", float), ("dropout", float),
                          ("train_audio_rows", bool), ("train_head", bool)):  # fmt: skip
            object.__setattr__(self, key, kind(getattr(self, key)))
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @classmethod
    def from_config(cls, lora, converters: list[str]) -> LoraSettings | None:
        """The ``[lora]`` section when ``model.converters`` lists ``"lora"``, else None."""
        if CONVERTER not in converters:
            return None
        return cls(**{key: copy.deepcopy(getattr(lora, key)) for key in SETTING_KEYS})

    @classmethod
    def from_dict(cls, settings: dict | None) -> LoraSettings | None:
        """A run record's or export's ``lora`` entry (empty or null: no LoRA)."""
        if not settings:
            return None
        return cls(**{key: settings[key] for key in SETTING_KEYS if key in settings})

    def to_dict(self) -> dict:
        """The recorded form (JSON's: a list of target modules)."""
        return {**asdict(self), "target_modules": list(self.target_modules)}


def lora_config(settings: LoraSettings, targets: list[str]):
    """PEFT's LoraConfig of these settings over the exact module names ``targets``."""
    peft = peft_module()
    return peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(targets),
        bias="none",
    )


def apply_lora(model: nn.Module, settings: LoraSettings) -> list[str]:
    """Wrap the selected decoder layers of a SpeechLM (meta or real) in PEFT LoRA layers and set
    what trains; returns the wrapped modules' names inside the backbone."""
    peft = peft_module()
    targets = match_targets(model.backbone, list(settings.target_modules))
    peft.inject_adapter_in_model(lora_config(settings, targets), model.backbone, ADAPTER)
    for module in (model.tok_embeddings, model.backbone, model.head):  # the LM; other parts
        for p in module.parameters():  # (an audio encoder) keep their own freeze settings
            p.requires_grad_(False)
    for name, p in model.backbone.named_parameters():
        p.requires_grad_(is_lora_param("." + name))
    layout = model.args.layout
    text = (layout.text_offset, layout.text_offset + layout.text_size)
    audio, head = settings.train_audio_rows, settings.train_head
    head_weight = model.tok_embeddings if model.args.tie_embeddings else model.head.output
    if audio:
        for module in (model.tok_embeddings, head_weight, model.head.stream_emb):
            module.weight.requires_grad_(True)
        model.tok_embeddings.frozen_rows = model.head.frozen_rows = text
    if head:
        head_weight.weight.requires_grad_(True)
        model.head.frozen_rows = None
        if model.args.tie_embeddings:  # one tensor: the whole table trains
            model.tok_embeddings.frozen_rows = None
    if not audio and not head:
        model.head.frozen_rows = model.tok_embeddings.frozen_rows = None
    return targets


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{name inside the backbone: PEFT LoRA layer}."""
    peft = peft_module()
    return {
        n: m for n, m in model.backbone.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)
    }


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight (PEFT's ``merge``) and put the base layers back
    in place: the plain SpeechLM, computing what the LoRA model computed."""
    for name, layer in lora_layers(model).items():
        layer.merge(adapter_names=[ADAPTER])
        parent, _, child = name.rpartition(".")
        owner = model.backbone.get_submodule(parent) if parent else model.backbone
        setattr(owner, child, layer.get_base_layer())
    model.args.lora = None


def adapter_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{our base weight name (``backbone.<layer>.weight``): (lora_A, lora_B)}; the layer's
    weight delta is ``alpha / rank * B @ A``."""
    out = {}
    for name, layer in lora_layers(model).items():
        a = layer.lora_A[ADAPTER].weight.detach()
        b = layer.lora_B[ADAPTER].weight.detach()
        out[f"backbone.{name}.weight"] = (a, b)
    return out


def trained_parameters(model: nn.Module) -> int:
    """Elements training changes: those of the parameters that require grad, less the rows a
    gradient mask holds (``frozen_rows``: LoRA keeps the text rows of the embedding and the head
    as loaded, model/embedding.py's ``hold_rows``). A tied head shares the embedding's tensor
    and its held rows: counted once."""
    head = getattr(model.head, "output", None)
    held: dict[int, int] = {}
    for module, weight in ((model.tok_embeddings, model.tok_embeddings.weight),
                           (model.head, head.weight if head is not None else None)):  # fmt: skip
        rows = getattr(module, "frozen_rows", None)
        if weight is not None and rows is not None and weight.requires_grad:
            count = (rows[1] - rows[0]) * weight.shape[1]
            held[id(weight)] = max(held.get(id(weight), 0), count)
    return sum(p.numel() - held.get(id(p), 0) for p in model.parameters() if p.requires_grad)
