"""``torchtitan export``: a training checkpoint -> a self-contained model folder.

    torchtitan export --checkpoint DUMP/checkpoint/step-N --out-dir DIR [--dtype bf16|fp32|fp16]
                      [--text-only] [--adapter] [--max-shard-size 5GB] [--force]

``export_command(ExportArgs)`` is the command as a Python function (commands/export_args.py: the
settings, one field per flag); ``main(argv)`` parses a command line into it; ``export`` below is
the work itself, for a caller with a checkpoint and a folder.

Reads the DCP checkpoint in one CPU process without a process group (whatever number of ranks
wrote it), rebuilds the model from the run's ``speechlm_run.json``, checks every parameter is
there, and writes the folder described in ``model/pretrained.py`` (or, with ``--text-only``, only the
text LM inside as a transformers causal-LM folder). The folder is written next to ``DIR`` and
renamed into place at the end: an existing ``DIR`` is never touched without ``--force``.

A LoRA run's adapters (model/lora.py) are merged into the weights: the folder holds a plain
model. With ``--adapter`` they stay apart: the SpeechLM folder keeps them (``from_pretrained``
rebuilds the LoRA layers), ``text/`` holds the text LM's base weights and ``adapter/`` a PEFT
adapter for it (``peft.PeftModel.from_pretrained(text_model, "DIR/adapter")``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

from torchtitan_speechlm.commands.export_args import DTYPE_NAMES, ExportArgs, build_parser
from torchtitan_speechlm.model.backbones import split_stacked
from torchtitan_speechlm.model.lora import (
    adapter_tensors,
    base_name,
    is_lora_param,
    lora_config,
    merge_lora,
)
from torchtitan_speechlm.model.model import build_model, check_keys
from torchtitan_speechlm.model.pretrained import (
    EXPORT_MODEL_TYPE,
    EXPORT_VERSION,
    PretrainedError,
    args_from_record,
    load_checkpoint_state,
    write_safetensors,
)
from torchtitan_speechlm.model.run_record import (
    model_args_of,
    model_record,
    record_for_checkpoint,
    recorded_codec,
)
from torchtitan_speechlm.model.state_dict_adapter import text_tensor_map
from torchtitan_speechlm.utils.fileio import honour_umask, write_json_atomic

DTYPES = dict(zip(DTYPE_NAMES, (torch.bfloat16, torch.float16, torch.float32), strict=True))
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def text_lm_state(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text LM inside, under transformers' module names (``model.``, ``lm_head``)."""
    family, config = model.args.family, model.args.backbone_config
    out = {}
    for key, (name, rows) in text_tensor_map(model.args, state).items():
        value = state[name] if rows is None else state[name][rows]
        out.update(split_stacked(key, family.to_checkpoint(name, value, config)))
    family = model.args.family
    if family.head_key and family.head_key not in out:  # a tied SpeechLM head: the embedding
        out[family.head_key] = out[family.embed_key]
    return out


def save_text_lm(model, state, out: str, dtype: torch.dtype, max_shard: int) -> None:
    """The text LM as a transformers causal-LM folder (``AutoModelForCausalLM`` loads it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(model.args.backbone_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    text = {k: v.to(dtype) for k, v in text_lm_state(model, state).items()}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    if set(text) != set(hf.state_dict()):
        # checkpoint names that transformers' modules convert on load (e.g. the per-expert
        # tensors of Qwen3-MoE, fused in its module): written as they are, as on the Hub
        if config.tie_word_embeddings:
            text.pop(model.args.family.head_key, None)
        config.dtype = dtype
        os.makedirs(out, exist_ok=True)
        config.save_pretrained(out)
        write_safetensors(text, out, max_shard)
        return
    hf.load_state_dict(text, strict=True, assign=True)
    hf.save_pretrained(out, max_shard_size=max_shard)


def base_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA model's state without its adapters, under the plain layers' names."""
    return {base_name(k): v for k, v in state.items() if not is_lora_param(k)}


def save_peft_adapter(model, out: str, dtype: torch.dtype, base: str) -> None:
    """The LoRA adapters as a PEFT adapter folder for the exported text LM ``base`` (its final
    path): adapter_config.json and adapter_model.safetensors under PEFT's names
    (``base_model.model.<module>.lora_A.weight``)."""
    from safetensors.torch import save_file

    family, config = model.args.family, model.args.backbone_config
    tensors, targets = {}, []
    for name, (a, b) in adapter_tensors(model).items():
        module = family.checkpoint_key(name).removesuffix(".weight")
        targets.append(module)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(dtype).contiguous()
        b = family.to_checkpoint(name, b, config)  # e.g. the native q/k row order
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(dtype).contiguous()
    cfg = lora_config(model.args.lora, targets)
    # PEFT resolves the base against the current directory, not the adapter folder: the text
    # LM's absolute path (AutoPeftModelForCausalLM then loads from any directory)
    cfg.task_type, cfg.base_model_name_or_path = "CAUSAL_LM", os.path.abspath(base)
    os.makedirs(out, exist_ok=True)
    cfg.save_pretrained(out)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})


def export(
    checkpoint: str,
    out: str,
    dtype: str = "fp32",
    text_only: bool = False,
    max_shard_size: int = 5 << 30,
    force: bool = False,
    adapter: bool = False,
) -> dict:
    """Export ``checkpoint`` (a ``step-N`` folder) to ``out``; returns what was written."""
    checkpoint, out = os.path.abspath(checkpoint), os.path.abspath(out)
    if os.path.isfile(os.path.join(checkpoint, "config.json")):  # what load_model reads as one
        raise PretrainedError(
            f"{checkpoint} is a model folder (it has a config.json), not a training checkpoint: "
            "it needs no export (generate, eval and serve take it as --model); export reads "
            "DUMP/checkpoint/step-N of a `torchtitan train` run"
        )
    if os.path.exists(out) and not force:
        raise PretrainedError(
            f"{out} exists; pass --force to replace it, or choose another --out-dir"
        )
    if dtype not in DTYPES:
        raise PretrainedError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    record = record_for_checkpoint(checkpoint)
    codec = recorded_codec(record)  # read before a merge rewrites the record's model args
    args = args_from_record(record["model_args"], record.get("hf_assets_path", ""))
    if adapter and not args.lora:
        raise PretrainedError(f"--adapter: {checkpoint} is not from a LoRA run (no adapters)")
    model = build_model(args)
    names = {n for n, _ in model.named_parameters()}
    state = load_checkpoint_state(checkpoint, names)
    check_keys(model, state, checkpoint)
    model.load_state_dict(state, strict=False)
    if args.lora and not adapter:  # the plain model, computing the same
        merge_lora(model)
        state = {n: p.detach() for n, p in model.named_parameters()}
        record = dict(record, model_args=model_record(model.args))
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=parent)
    try:
        files = _write(
            model, state, record, codec, checkpoint, tmp, DTYPES[dtype], text_only,
            max_shard_size,
        )  # fmt: skip
        if adapter:
            text = os.path.join(out, "text")  # where the text LM is once the folder is in place
            save_peft_adapter(model, os.path.join(tmp, "adapter"), DTYPES[dtype], text)
            files = sorted(os.listdir(tmp))
        honour_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600: the user's umask instead
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "files": files, "parameters": sum(v.numel() for v in state.values())}


def _write(model, state, record, codec, checkpoint, out, dtype, text_only, max_shard) -> list[str]:
    tok = record["tokenizer"].get("path", "")
    if text_only:
        if not model.args.family.embed_key:
            raise PretrainedError(f"the {model.args.backbone!r} backbone has no HF text model")
        save_text_lm(model, base_state(state), out, dtype, max_shard)
        _copy_tokenizer(tok, out)
        return sorted(os.listdir(out))
    cast = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    write_safetensors(cast, out, max_shard)
    write_json_atomic(os.path.join(out, "vocab.json"), model.args.vocab, indent=1)
    if codec.path and os.path.isdir(codec.path):
        shutil.copytree(codec.path, os.path.join(out, "codec"))
        codec = codec.located("codec")
    config = {
        "model_type": EXPORT_MODEL_TYPE,
        "format_version": EXPORT_VERSION,
        "architectures": ["SpeechLM"],
        "dtype": str(dtype).replace("torch.", ""),
        "model_args": model_args_of(record),
        "codec": codec.to_dict(),
        "tokenizer": record["tokenizer"],
        "source": {
            "checkpoint": checkpoint,
            "model_name": record.get("model_name"),
            "hf_assets_path": record.get("hf_assets_path"),
        },
    }
    write_json_atomic(os.path.join(out, "config.json"), config)
    _copy_tokenizer(tok, out, skip=("vocab.json",))  # ours is the SpeechLM vocabulary layout
    if model.args.family.embed_key:
        save_text_lm(model, base_state(state), os.path.join(out, "text"), dtype, max_shard)
        _copy_tokenizer(tok, os.path.join(out, "text"))
    return sorted(os.listdir(out))


def _copy_tokenizer(path: str, out: str, skip=()) -> None:
    if not path or not os.path.isdir(path):
        return  # the tokenizer's path and hash stay in config.json
    for name in TOKENIZER_FILES:
        if name not in skip and os.path.isfile(os.path.join(path, name)):
            shutil.copy2(os.path.join(path, name), os.path.join(out, name))


def main(argv: list[str] | None = None) -> int:
    """``torchtitan export`` of a command line (without the command's name)."""
    return export_command(ExportArgs.from_namespace(build_parser().parse_args(argv)))


def run(a: argparse.Namespace) -> int:
    """``torchtitan export`` of the command line cli.py parsed."""
    return export_command(ExportArgs.from_namespace(a))


def export_command(args: ExportArgs) -> int:
    """``torchtitan export``: ``args.checkpoint`` written as a model folder at ``args.out_dir``;
    the exit status (2: an error, said on stderr)."""
    try:
        args.validate()
        summary = export(
            args.checkpoint,
            args.out_dir,
            args.dtype,
            args.text_only,
            args.shard_bytes(),
            args.force,
            args.adapter,
        )
    except (PretrainedError, ValueError, FileNotFoundError) as e:
        print(f"torchtitan export: error: {e}", file=sys.stderr)
        return 2
    print(
        f"exported {summary['parameters']:,} parameters to {summary['out']}: "
        f"{', '.join(summary['files'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
