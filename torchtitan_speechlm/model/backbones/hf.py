"""The ``hf`` backbone: any local transformers causal-LM directory as the SpeechLM decoder.

We keep transformers' own decoder stack (``AutoModel.from_config``: Llama, Qwen2, Qwen3, Qwen3-MoE,
...), so attention variants, RoPE scaling, sliding windows and packed-sequence masks stay exactly
transformers', and only replace what a speech LM changes: the token embedding and the output head
(extended vocabulary, several streams). Pretrained weights are read tensor by tensor from the
directory's safetensors; text rows of the embedding / head are copied into the extended vocabulary.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from torchtitan_speechlm.model.backbones import Backbone, register_backbone
from torchtitan_speechlm.model.documents import NAME as DOCUMENT_ATTENTION
from torchtitan_speechlm.model.documents import Documents
from torchtitan_speechlm.model.documents import register as register_document_attention
from torchtitan_speechlm.utils import upstream

# transformers implementations that turn per-document position ids into a dense mask
DENSE_MASK_ATTENTION = ("sdpa", "eager")
HF_EMBED = "model.embed_tokens.weight"
HF_HEAD = "lm_head.weight"


def require_backbone_dir(path: str) -> Path:
    p = Path(path).expanduser()
    if not path or not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"model.hf_assets_path = {path!r}: no config.json there. Point it at a local Hugging Face "
            "causal-LM directory (config.json, optionally *.safetensors), e.g. one written by "
            "`save_pretrained` or downloaded beforehand with `huggingface-cli download`."
        )
    return p


# keys of transformers 4 checkpoints that transformers 5 converts on load (to ``dtype`` and
# ``rope_parameters``): known, although no config class declares them any more
CONVERTED_KEYS = frozenset({"torch_dtype", "rope_scaling", "rope_theta"})


def load_hf_config(path: str):
    """The transformers config of a checkpoint folder; an unknown ``model_type`` is one line
    naming the file and the installed transformers."""
    import transformers
    from transformers import AutoConfig

    folder = require_backbone_dir(path)
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError) as e:
        raw = _read_json(folder / "config.json")
        raise ValueError(
            f"{folder / 'config.json'}: model_type {raw.get('model_type')!r} is unknown to the "
            f"installed transformers {transformers.__version__} ({str(e).splitlines()[0]}); "
            "install a transformers that has it, or point model.hf_assets_path at another "
            "backbone"
        ) from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON config ({e})") from None


def unknown_config_keys(path: str, hf_config) -> list[str]:
    """Keys of the folder's config.json that the installed transformers' config class neither
    declares nor converts: transformers keeps them as attributes, and no layer reads them, so a
    key meant to change the model (a newer release's option) would be ignored."""
    from transformers import PretrainedConfig

    raw = _read_json(Path(path) / "config.json")
    cls = type(hf_config)
    known = set(cls().to_dict()) | set(PretrainedConfig().to_dict()) | CONVERTED_KEYS
    known |= set(getattr(cls, "attribute_map", {}))
    return sorted(k for k in raw if k not in known and not hasattr(cls, k))


def build_backbone(hf_config, attn_implementation: str = "sdpa") -> nn.Module:
    """The HF base model (decoder layers + final norm + rotary), without its text embedding."""
    from transformers import AutoModel

    if attn_implementation == DOCUMENT_ATTENTION:
        register_document_attention()
    elif attn_implementation in DENSE_MASK_ATTENTION:
        upstream.logger.warning(
            f"attn_implementation = {attn_implementation!r}: transformers builds a dense "
            "[B, 1, T, T] mask for packed rows (memory and time grow with T^2); the default "
            f"{DOCUMENT_ATTENTION!r} attends within each document without one"
        )
    hf_config._attn_implementation = attn_implementation
    # The parameters take the run's dtype (torchtitan builds the model under
    # ``set_default_dtype(training.dtype)``, float32 by default), never the checkpoint's stored
    # ``dtype`` (bf16 for released checkpoints): FSDP2 refuses a model of mixed dtypes, and bf16
    # master weights would lose every update below bf16's resolution.
    backbone = AutoModel.from_config(
        hf_config, attn_implementation=attn_implementation, dtype=torch.get_default_dtype()
    )
    for attr in ("layers", "norm"):
        if not hasattr(backbone, attr):
            raise ValueError(
                f"backbone {type(backbone).__name__} has no `{attr}`: only decoder-only causal LMs "
                "with `model.layers` and `model.norm` (Llama, Qwen2, Qwen3, Qwen3-MoE, ...) are "
                "supported."
            )
    # Our StreamEmbedding replaces it; we always call the backbone with inputs_embeds.
    backbone.embed_tokens = None
    return backbone


def reset_non_persistent_buffers(backbone: nn.Module, device: torch.device) -> None:
    """Recompute buffers that are not in any checkpoint (RoPE inv_freq), lost by meta init."""
    for module in backbone.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            fresh = type(module)(config=module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))
            if hasattr(fresh, "attention_scaling"):
                module.attention_scaling = fresh.attention_scaling


class SafetensorsReader:
    """Lazy, tensor-by-tensor access to a local HF checkpoint (single file or sharded index)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {k: self.directory / v for k, v in weight_map.items()}
        else:
            self._files = {}
            for f in sorted(self.directory.glob("*.safetensors")):
                from safetensors import safe_open

                with safe_open(str(f), framework="pt") as sf:
                    self._files.update({k: f for k in sf.keys()})
        self._handles: dict[Path, object] = {}

    def __bool__(self) -> bool:
        return bool(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def keys(self) -> Iterator[str]:
        return iter(self._files)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self._files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f].get_tensor(name)


class PretrainedWeights:
    """Pretrained tensors by HF name: straight from safetensors when the names match, else from
    transformers' own loading (which applies its checkpoint conversions, e.g. per-expert MoE
    weights fused into ``experts.gate_up_proj``). The slow path loads the model once, on CPU."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.reader = SafetensorsReader(directory)
        self._converted: dict[str, torch.Tensor] | None = None

    def __bool__(self) -> bool:
        return bool(self.reader)

    def _converted_state(self) -> dict[str, torch.Tensor]:
        if self._converted is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(
                str(self.directory), local_files_only=True, dtype=torch.float32
            )
            self._converted = {k: v.detach() for k, v in model.state_dict().items()}
        return self._converted

    def __contains__(self, name: str) -> bool:
        return name in self.reader or name in self._converted_state()

    def get(self, name: str) -> torch.Tensor:
        if name in self.reader:
            return self.reader.get(name)
        return self._converted_state()[name]


def hf_name(our_name: str) -> str | None:
    """Our backbone FQN -> the HF checkpoint key (None for parameters HF does not have)."""
    if our_name.startswith("backbone."):
        return "model." + our_name[len("backbone.") :]
    return None


class HFBackbone(Backbone):
    """transformers' decoder stack (``AutoModel.from_config``: Llama, Qwen2, Qwen3, Qwen3-MoE, ...)
    of a local HF causal-LM folder, called with ``inputs_embeds``."""

    embed_key, head_key = HF_EMBED, HF_HEAD

    def read_config(self, path: str) -> dict:
        config = load_hf_config(path)
        unknown = unknown_config_keys(path, config)
        if unknown:
            import transformers

            upstream.logger.warning(
                f"{Path(path) / 'config.json'}: {', '.join(unknown)} unknown to transformers "
                f"{transformers.__version__}'s {type(config).__name__} (kept, but no layer of "
                "this version reads them)"
            )
        return config.to_dict()

    def hf_config(self, config: dict):
        from transformers import AutoConfig

        d = dict(config)
        return AutoConfig.for_model(d.pop("model_type"), **d)

    def moe(self, config: dict) -> tuple[int, int] | None:
        # transformers 5 stores num_experts as num_local_experts in to_dict() (attribute_map)
        e = config.get("num_experts") or config.get("num_local_experts")
        k = config.get("num_experts_per_tok")
        return (int(e), int(k)) if e and k else None

    def build(self, config: dict, attn_implementation: str) -> nn.Module:
        return build_backbone(self.hf_config(config), attn_implementation)

    def run(self, module, inputs_embeds, position_ids, real):
        moe = self.moe(module.config.to_dict())
        extra = {"output_router_logits": True} if moe else {}
        if module.config._attn_implementation == DOCUMENT_ATTENTION and position_ids is not None:
            # grouped once per forward, outside the compiled layers: every layer's attention
            # gets them (transformers hands extra keywords to the attention interface)
            extra["documents"] = Documents(position_ids)
        out = module(
            inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False, **extra
        )
        aux = None
        if moe and getattr(out, "router_logits", None):
            # transformers' own Switch-style aux loss (E * sum_e f_e P_e), over real frames only
            lb_fn = sys.modules[type(module).__module__].load_balancing_loss_func
            aux = lb_fn(tuple(out.router_logits), moe[0], moe[1], real.float())
        return out.last_hidden_state, aux

    def decode(self, module, inputs_embeds, position_ids, attention_mask, cache):
        from transformers import DynamicCache

        extra = {}
        if cache is None and module.config._attn_implementation == DOCUMENT_ATTENTION:
            # the prefill: grouped once for all layers (they attend without a mask when the
            # prompt has no padding; later one-frame steps attend over the cache)
            extra["documents"] = Documents(position_ids)
        cache = DynamicCache(config=module.config) if cache is None else cache
        out = module(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=True,
            **extra,
        )
        return out.last_hidden_state, out.cache

    def select_rows(self, cache, index):
        """transformers' ``Cache.batch_select_indices`` (in place)."""
        cache.batch_select_indices(index)
        return cache

    def can_join(self, cache) -> bool:
        """Only a cache of plain growing layers (``DynamicLayer``; no sliding window, no
        recurrent state) is joined: its keys are [B, heads, length, head_dim] in every layer."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        return bool(layers) and all(
            type(layer) is DynamicLayer and layer.is_initialized for layer in layers
        )

    def join_rows(self, cache, other):
        """Per layer, ``other``'s keys and values after ``cache``'s along the batch, the shorter
        left-padded with zeros (masked by the joined attention mask), in ``cache`` (in place)."""
        if not (self.can_join(cache) and self.can_join(other)):
            raise NotImplementedError("join_rows: a cache of other than DynamicLayer layers")
        for mine, theirs in zip(cache.layers, other.layers, strict=True):
            length = max(mine.keys.shape[-2], theirs.keys.shape[-2])
            mine.keys = torch.cat(
                [_left_padded(mine.keys, length), _left_padded(theirs.keys, length)]
            )
            mine.values = torch.cat(
                [_left_padded(mine.values, length), _left_padded(theirs.values, length)]
            )
        return cache

    def drop_first_slots(self, cache, n: int):
        """Each layer's keys and values without their first ``n`` slots (in place)."""
        if not self.can_join(cache):
            raise NotImplementedError("drop_first_slots: a cache of other than DynamicLayer layers")
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[..., n:, :], layer.values[..., n:, :]
        return cache

    def reset_buffers(self, module, device) -> None:
        reset_non_persistent_buffers(module, device)

    def weights(self, path: str):
        reader = PretrainedWeights(path)
        return reader if reader else None

    def checkpoint_key(self, name: str) -> str | None:
        return hf_name(name)


register_backbone("hf", HFBackbone())


def _left_padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` [B, heads, T, head_dim] with zeros before its T slots, to ``length`` slots."""
    missing = length - t.shape[-2]
    return t if missing == 0 else torch.nn.functional.pad(t, (0, 0, missing, 0))
