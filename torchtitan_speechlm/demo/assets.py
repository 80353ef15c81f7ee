"""The demo's assets, made here from scratch (nothing downloaded) and saved with
``save_pretrained`` so they load back through the real loading code: the packaged sentences, a
byte-level BPE tokenizer, a random-init causal-LM backbone and a speech corpus spoken by the
``espeak-ng`` binary. (The tests reuse them; their own tiny codecs are in tests/tiny_codecs.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import soundfile as sf
import torch

from torchtitan_speechlm.utils.audio import load_audio
from torchtitan_speechlm.utils.fileio import write_text_atomic

SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}


def load_sentences() -> list[str]:
    """The packaged list of short English sentences (``demo/sentences.txt``)."""
    path = os.path.join(os.path.dirname(__file__), "sentences.txt")
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def build_tokenizer(
    out_dir: str, sentences: list[str], vocab_size: int = 256, specials: dict | None = None
) -> str:
    """Train a byte-level BPE on ``sentences`` and save it as a transformers tokenizer.

    The full 256-byte alphabet and three special tokens are always in the vocabulary so any
    text can be encoded; the real size is therefore ``max(vocab_size, 259)``. ``specials``:
    other names for the bos, eos and pad tokens (``SPECIAL_TOKENS``' keys); ESPnet's job
    template refuses a tokenizer whose tokens share a name with its own specials.
    """
    specials = specials or SPECIAL_TOKENS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    fast.save_pretrained(out_dir)
    return out_dir


def build_backbone(
    out_dir: str,
    family: str = "qwen3",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> str:
    """Save a tiny random-init causal LM (qwen3, llama, qwen2 or qwen3_moe) to ``out_dir``."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "qwen3":
        config, cls = (
            tf.Qwen3Config(head_dim=hidden_size // num_heads, **common),
            tf.Qwen3ForCausalLM,
        )
    elif family == "llama":
        config, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "qwen2":
        config, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            head_dim=hidden_size // num_heads,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=intermediate_size // 2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(
            f"unknown backbone family {family!r}; expected qwen3, llama, qwen2 or qwen3_moe"
        )
    torch.manual_seed(seed)
    cls(config).save_pretrained(out_dir)
    return out_dir


DEFAULT_VOICES = ("en-us", "en-gb", "en-us+f3", "en-gb+m3", "en-us+m3", "en-gb+f3")
SPEEDS = (140, 165, 190)


def _count_lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def espeak_exe() -> str:
    """The espeak-ng binary, or a RuntimeError saying how to install it."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError(
            "espeak-ng not found: install it with `apt-get install espeak-ng` (the Makefile does)"
        )
    return exe


def speak(
    text: str,
    voice: str,
    speed: int,
    sample_rate: int = 16000,
    pitch: int | None = None,
    tmp_dir: str | None = None,
) -> np.ndarray:
    """espeak-ng's speech of ``text`` (``-v voice -s speed``, and ``-p pitch`` if given: 0-99,
    espeak-ng's default 50) at ``sample_rate``, float32, peak-normalised to 0.9."""
    with tempfile.NamedTemporaryFile(suffix=".wav", dir=tmp_dir) as raw:
        cmd = [espeak_exe(), "-w", raw.name, "-v", voice, "-s", str(speed)]
        cmd += ["-p", str(pitch)] if pitch is not None else []
        subprocess.run([*cmd, "--stdin"], input=text.encode(), check=True, capture_output=True)
        wav = load_audio(raw.name, sample_rate)
    peak = float(np.abs(wav).max()) or 1.0
    return (0.9 * wav / peak).astype(np.float32)


def synthesize_corpus(
    out_dir: str,
    sentences: list[str],
    n: int = 200,
    voices: list[str] | None = None,
    sample_rate: int = 16000,
    speeds: tuple[int, ...] = SPEEDS,
) -> str:
    """Speak ``n`` sentences with espeak-ng into ``<out_dir>/wavs`` and write ``manifest.jsonl``.

    Voices and speeds (words per minute) cycle for variety. A manifest with ``n`` lines already present means the
    work is done (the manifest is written last, atomically). Returns the manifest path.
    (A corpus of several speakers, each line naming its speaker: ``demo/voices.py``.)
    """
    manifest = os.path.join(out_dir, "manifest.jsonl")
    if os.path.isfile(manifest) and _count_lines(manifest) == n:
        return manifest
    espeak_exe()
    if not sentences:
        raise ValueError("synthesize_corpus needs at least one sentence")
    voices = list(voices or DEFAULT_VOICES)
    wav_dir = os.path.join(out_dir, "wavs")
    os.makedirs(wav_dir, exist_ok=True)

    def one(i: int) -> dict:
        text = sentences[i % len(sentences)]
        rel = f"wavs/utt{i:05d}.wav"
        voice, speed = voices[i % len(voices)], speeds[(i // len(voices)) % len(speeds)]
        wav = speak(text, voice, speed, sample_rate, tmp_dir=wav_dir)
        sf.write(os.path.join(out_dir, rel), wav, sample_rate, subtype="PCM_16")
        return {"id": f"utt{i:05d}", "audio": rel, "text": text}

    with ThreadPoolExecutor(max_workers=2) as pool:
        rows = list(pool.map(one, range(n)))
    write_text_atomic(manifest, "".join(json.dumps(row) + "\n" for row in rows))
    return manifest
