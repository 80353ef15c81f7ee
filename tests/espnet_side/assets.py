"""A tiny ESPnet SpeechLM setup on disk for the tests: a backbone folder holding its tokenizer
(as an HF model repository does, so ESPnet's text io reads both from one tag), a codec of
ours, a corpus in ESPnet's format with its length statistics, and the job config ESPnet's
``bin/train.py`` reads (its YAML, as a dict)."""

from __future__ import annotations

import os

# names that do not collide with ESPnet's own specials (its job template asserts so), as real
# tokenizers' (Qwen's <|endoftext|>, Llama's <|begin_of_text|>) do not
TOKENIZER_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
TASKS = ("text_to_audio", "audio_to_text", "text_only")


def make_espnet_assets(root, n_items: int = 24, seed: int = 0, codec: str = "encodec",
                       delay: bool = True, family: str = "qwen3") -> dict:  # fmt: skip
    from transformers import AutoTokenizer

    from tests.espnet_side.corpus import tone_items, write_corpus
    from tests.helpers import TINY_BACKBONE
    from tests.real_checkpoints import SHIPPED_AS, dress_as_shipped
    from tests.tiny_codecs import build_codec
    from torchtitan_speechlm.demo.assets import build_backbone, build_tokenizer, load_sentences

    root = str(root)
    paths = {k: os.path.join(root, k) for k in ("backbone", "codec", "corpus", "stats")}
    sentences = load_sentences()
    build_tokenizer(paths["backbone"], sentences, specials=TOKENIZER_SPECIALS)
    vocab = len(AutoTokenizer.from_pretrained(paths["backbone"]))
    build_backbone(paths["backbone"], family=family, vocab_size=vocab, seed=seed, **TINY_BACKBONE)
    dress_as_shipped(paths["backbone"], SHIPPED_AS[family])
    build_codec(paths["codec"], kind=codec, seed=seed)
    items = tone_items(paths["corpus"], sentences[:n_items], seed=seed)
    paths["data_json"] = write_corpus(items, paths["corpus"])
    paths["delay"] = delay
    paths["items"] = [i for i, _, _ in items]
    return paths


def job_config(assets: dict, audio_input: str = "discrete_audio", batch_size: int = 300,
               continuous: bool = False, io_order=("text", "discrete_audio"),
               audio_kwargs: dict | None = None) -> dict:  # fmt: skip
    """ESPnet's training YAML for these assets (``job_type``, ``multimodal_io``,
    ``preprocessor``, ``data_loading``, ``model``; ``trainer`` is the caller's).
    ``audio_kwargs``: more arguments of the discrete audio io (e.g. ESPnet's
    ``codec_max_token_per_frame``)."""
    ios = {
        "text": {"tokenizer_name": assets["backbone"]},
        "discrete_audio": {
            "codec_choice": "local",
            "codec_hf_model_tag": assets["codec"],
            "delay_interleave": assets["delay"],
            **(audio_kwargs or {}),
        },
    }
    if continuous:
        ios["continuous_audio"] = {"d_model": 32}
    return {
        "job_type": "speechlm",
        "multimodal_io": {name: ios[name] for name in (*io_order, *(
            ["continuous_audio"] if continuous else []))},
        "preprocessor": {"audio_input": audio_input, "audio_output": "discrete_audio",
                         "loss_region": "assistant"},
        "data_loading": {"batchfy_method": "bucket", "batch_size": batch_size,
                         "num_workers": 0, "seed": 0},
        "model": {"model_choice": "parallel", "model_hf_tag": assets["backbone"],
                  "model_conf": {}},
    }  # fmt: skip


def specifiers(assets: dict, tasks=("text_to_audio", "audio_to_text"), name="tiny") -> str:
    """ESPnet's unregistered specifier string ``task:name:data_json ...``."""
    return " ".join(f"{t}:{name}:{assets['data_json']}" for t in tasks)


def prepare_stats(assets: dict, config: dict, specs: str) -> None:
    """``bin/prepare_length_stats.py`` for ``specs`` (its stats_dir: ``assets['stats']``)."""
    from tests.espnet_side.corpus import write_length_stats
    from tests.espnet_side.job import SpeechLMJobTemplate

    pre = SpeechLMJobTemplate(config).build_preprocessor()
    write_length_stats(pre, specs.split(), assets["stats"])
