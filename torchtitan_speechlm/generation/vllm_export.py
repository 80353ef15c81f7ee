"""A ``flatten``-pattern SpeechLM written as a plain transformers causal LM over its extended
vocabulary, so that an engine serving plain causal LMs (vLLM: docs/vllm.md) can run it.

Why this is exact, not an approximation: with ``flatten`` every code sits in stream 0
(model/patterns.py) and the other streams always hold their pads, which embed to zero
(model/embedding.py); stream 0 reads the hidden state without a per-stream offset
(model/head.py) and predicts over the whole vocabulary (``Flatten.prediction_range``). So one
position is one id of the extended vocabulary, its input one row of ``tok_embeddings`` and its
logits ``h @ head.output.weight.T``: a causal LM with ``vocab_size = layout.size``, the
backbone's decoder unchanged. Two things stay ours and are written beside the weights in
``speechlm_layout.json``: the prompt (the training template's stream 0, ids of the extended
vocabulary: the text tokenizer alone does not give them) and the decoder's masks (output step
``t`` of an audio turn may only pick codebook ``t % N``'s codes, plus the end ids where
``t % N == 0`` and ``t // N >= min_frames``), which ``audio_allowed`` states and a serving
engine applies as a logits processor.

The one row that differs: stream 0's pad (codebook 0's pad id) embeds to zero in the SpeechLM;
it is zeroed here when the head is untied, and never occurs in a flatten prompt or output
either way (patterns fill only streams 1..N-1 with pads).

transformers is imported where a folder is written, as ``torchtitan export`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

from torchtitan_speechlm.generation.loading import load_model
from torchtitan_speechlm.model.backbones import split_stacked
from torchtitan_speechlm.model.lora import merge_lora
from torchtitan_speechlm.model.model import canonical_name
from torchtitan_speechlm.model.pretrained import write_safetensors
from torchtitan_speechlm.model.state_dict_adapter import text_tensor_map
from torchtitan_speechlm.utils.fileio import honour_umask

NOTE_FILE = "speechlm_layout.json"
# our decoder's masks as a vLLM logits processor (a standalone module), copied beside the weights:
# PYTHONPATH=OUT vllm serve OUT --logits-processors speechlm_vllm_mask:FlattenAudioMask
PLUGIN_FILE = os.path.join(os.path.dirname(__file__), "vllm_plugin", "speechlm_vllm_mask.py")
NOTE_FORMAT = "torchtitan-speechlm flatten causal LM"
NOTE_VERSION = 1


def check_servable(args) -> None:
    """Raise ValueError naming why a SpeechLM with ``args`` is not a plain causal LM."""
    if args.pattern != "flatten":
        raise ValueError(
            f"pattern {args.pattern!r}: only a flatten model is one token per step; delay and "
            "parallel emit one token per stream per step, which a plain causal LM cannot "
            "(docs/vllm.md)"
        )
    if args.audio is not None:
        raise ValueError(
            "the model reads audio through a continuous audio encoder, which a plain causal "
            "LM over token ids has no input for"
        )
    if not args.family.embed_key:
        raise ValueError(f"the {args.backbone!r} backbone has no transformers checkpoint names")


def layout_note(args) -> dict:
    """What a serving engine needs beside the weights: the id layout and the decoding rules."""
    lay = args.layout
    return {
        "format": NOTE_FORMAT,
        "version": NOTE_VERSION,
        "pattern": args.pattern,
        "num_streams": lay.num_streams,
        "codebook_size": lay.codebook_size,
        "vocab_size": lay.size,
        "codebook_first_ids": [lay.code(k, 0) for k in range(lay.num_streams)],
        "end_ids": [lay.special("<|eos|>"), lay.special("<|eot|>")],
        "text_ids": [lay.text_offset, lay.text_offset + lay.text_size],
        "specials": {name: lay.special(name) for name in lay.specials if "reserved" not in name},
        "vocab_fingerprint": lay.fingerprint(),
        "rules": {
            "prompt": "the training template's stream 0 (TemplateBuilder.prefix(...)[:, 0]); "
            "text token i of the tokenizer is id text_ids[0] + i",
            "audio": "output step t picks among codebook k = t % num_streams's ids "
            "[codebook_first_ids[k], + codebook_size); where k == 0 and t // num_streams >= "
            "min_frames the end_ids too; code (t // num_streams, k) = id - codebook_first_ids[k]",
            "text": "text ids [text_ids[0], text_ids[1]) and end_ids",
        },
    }


def audio_allowed(note: dict, step: int, min_frames: int = 1) -> list[tuple[int, int]]:
    """The id ranges ``[a, b)`` output step ``step`` of an audio turn may pick (our decoder's
    masks: generation/decode.py), from a ``speechlm_layout.json`` note."""
    n, size = note["num_streams"], note["codebook_size"]
    k, frame = step % n, step // n
    first = note["codebook_first_ids"][k]
    ranges = [(first, first + size)]
    if k == 0 and frame >= min_frames:
        ranges += [(e, e + 1) for e in note["end_ids"]]
    return ranges


def flatten_lm_state(model) -> dict:
    """The SpeechLM's tensors under transformers' names, the embedding and head whole (every
    row of the extended vocabulary)."""
    args = model.args
    family, config = args.family, args.backbone_config
    state = {canonical_name(n): p.detach() for n, p in model.named_parameters()}
    out = {}
    for key, (name, _rows) in text_tensor_map(args, state).items():
        out.update(split_stacked(key, family.to_checkpoint(name, state[name], config)))
    if args.tie_embeddings:
        out[family.head_key] = out[family.embed_key]
    else:  # stream 0's pad embeds to zero in the SpeechLM (StreamEmbedding)
        embed = out[family.embed_key].clone()
        embed[args.layout.stream_pad(0)] = 0
        out[family.embed_key] = embed
    return out


def hf_config(args):
    """The backbone's transformers config with the extended vocabulary and our special ids."""
    from transformers import AutoConfig

    lay = args.layout
    cfg = dict(args.backbone_config)
    cfg.update(
        vocab_size=lay.size,
        tie_word_embeddings=bool(args.tie_embeddings),
        bos_token_id=lay.special("<|bos|>"),
        eos_token_id=[lay.special("<|eos|>"), lay.special("<|eot|>")],
        pad_token_id=lay.pad,
    )
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def export_flatten_lm(model, out: str, dtype=None, max_shard_bytes: int = 5 << 30) -> list[str]:
    """Write ``model`` (a flatten SpeechLM, LoRA merged) to ``out`` as a transformers
    causal-LM folder (config.json, generation_config.json, safetensors) plus
    ``speechlm_layout.json`` and ``speechlm_vllm_mask.py`` (the masks for vLLM); returns the
    files written."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    args = model.args
    check_servable(args)
    if args.lora:
        raise ValueError("merge the LoRA adapters first (model/lora.py merge_lora)")
    dtype = dtype or torch.float32
    config = hf_config(args)
    config.dtype = dtype
    state = {k: v.to(dtype) for k, v in flatten_lm_state(model).items()}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    os.makedirs(out, exist_ok=True)
    if set(state) == set(hf.state_dict()):
        hf.load_state_dict(state, strict=True, assign=True)
        hf.save_pretrained(out, max_shard_size=max_shard_bytes)
    else:  # names transformers converts on load (per-expert MoE tensors): written as on the Hub
        if args.tie_embeddings:
            state.pop(args.family.head_key, None)
        config.save_pretrained(out)
        write_safetensors(state, out, max_shard_bytes)
    lay = args.layout
    GenerationConfig(
        bos_token_id=lay.special("<|bos|>"),
        eos_token_id=[lay.special("<|eos|>"), lay.special("<|eot|>")],
        pad_token_id=lay.pad,
        do_sample=False,
    ).save_pretrained(out)
    with open(os.path.join(out, NOTE_FILE), "w") as f:
        json.dump(layout_note(args), f, indent=1)
    shutil.copyfile(PLUGIN_FILE, os.path.join(out, os.path.basename(PLUGIN_FILE)))
    return sorted(os.listdir(out))


def export_from(path: str, out: str, dtype: str = "fp32") -> list[str]:
    """``export_flatten_lm`` of a ``torchtitan export`` folder or a checkpoint step folder."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"--dtype {dtype!r}: choose one of {sorted(dtypes)}")
    model = load_model(path).model
    if model.args.lora:
        merge_lora(model)
    files = export_flatten_lm(model, out, dtypes[dtype])
    # safetensors writes 0600 files (the others were written under the umask already)
    honour_umask(out, [f for f in files if f.endswith(".safetensors")])
    return files


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_speechlm.generation.vllm_export",
        description="Write a flatten SpeechLM as a plain causal LM folder (docs/vllm.md).",
    )
    p.add_argument("model", help="a `torchtitan export` folder or a checkpoint step folder")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        files = export_from(a.model, a.out, a.dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"vllm_export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: {', '.join(files)}")
    print(
        f"serve it with vLLM's Python: PYTHONPATH={a.out} python -m "
        f"vllm.entrypoints.openai.api_server --model {a.out} --skip-tokenizer-init --dtype "
        "float32 --logits-processors speechlm_vllm_mask:FlattenAudioMask; then torchtitan serve "
        f"--model {a.model} --engine vllm --vllm-url URL (docs/serving.md)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
