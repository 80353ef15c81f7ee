"""Test helpers: build a SpeechLM from a tiny saved HF backbone through the real loading code."""

from __future__ import annotations

import os

import torch

from tests.real_checkpoints import SHIPPED_AS, dress_as_shipped
from torchtitan_speechlm.model.args import SpeechLMModelArgs
from torchtitan_speechlm.model.backbones.hf import load_hf_config
from torchtitan_speechlm.model.model import SpeechLM
from torchtitan_speechlm.model.vocab import VocabLayout

# tiny Qwen3 configs (save_tiny_backbone overrides): dense, and mixture-of-experts
QWEN3_DENSE = dict(hidden_size=64, head_dim=16, intermediate_size=96)
QWEN3_MOE = dict(
    **QWEN3_DENSE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    norm_topk_prob=True,
)  # fmt: skip


def save_tiny_backbone(path, family="qwen3", vocab_size=96, tie=False, seed=0, **overrides):
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
    )
    common.update(overrides)
    cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[family]
    cls[1](cls[0](**common)).save_pretrained(path)
    # the keys, dtype (bf16) and generation config of the checkpoint users bring of this
    # family; the model returned is the folder as transformers reads it (float32)
    dress_as_shipped(path, SHIPPED_AS[family])
    return cls[1].from_pretrained(path, dtype=torch.float32)


def build_speechlm(backbone_dir, num_streams=3, codebook_size=16, tie=None, **kw) -> SpeechLM:
    hf = load_hf_config(str(backbone_dir))
    layout = VocabLayout(
        text_size=hf.vocab_size, num_streams=num_streams, codebook_size=codebook_size
    )
    args = SpeechLMModelArgs(
        hf_assets_path=str(backbone_dir),
        backbone_config=hf.to_dict(),
        vocab=layout.to_dict(),
        tie_embeddings=hf.tie_word_embeddings if tie is None else tie,
        **kw,
    )
    with torch.device("meta"):
        model = SpeechLM(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def text_only_inputs(layout: VocabLayout, text_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] text ids -> [B, T, N] frames: text in stream 0, each other stream's pad."""
    b, t = text_ids.shape
    frames = torch.empty(b, t, layout.num_streams, dtype=torch.long)
    frames[..., 0] = layout.text_offset + text_ids
    for k in range(1, layout.num_streams):
        frames[..., k] = layout.stream_pad(k)
    return frames


# ---------------------------------------------------------------------------------------------
# Tiny end-to-end assets and configs for `torchtitan train` tests
# ---------------------------------------------------------------------------------------------
TINY_BACKBONE = dict(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)


def tiny_model_assets(root, family="qwen3", seed=0, tie=False, **backbone) -> dict:
    """Tokenizer, tiny codec and tiny backbone (``family``, sized TINY_BACKBONE) under
    ``root``, each saved with save_pretrained; returns their paths (and "prepared", unmade)."""
    import os

    from transformers import AutoTokenizer

    from tests.tiny_codecs import build_codec
    from torchtitan_speechlm.demo.assets import build_backbone, build_tokenizer, load_sentences

    root = str(root)
    paths = {k: os.path.join(root, k) for k in ("tokenizer", "codec", "backbone", "prepared")}
    build_tokenizer(paths["tokenizer"], load_sentences())
    build_codec(paths["codec"], seed=seed)
    vocab = len(AutoTokenizer.from_pretrained(paths["tokenizer"]))
    build_backbone(
        paths["backbone"],
        family=family,
        vocab_size=vocab,
        seed=seed,
        tie_word_embeddings=tie,
        **{**TINY_BACKBONE, **backbone},
    )
    # the keys, dtype (bf16) and generation config of the checkpoint users bring of this family
    dress_as_shipped(paths["backbone"], SHIPPED_AS[family])
    return paths


def make_tiny_run_assets(
    root, n_items=48, seed=0, tie=False, family="qwen3", speakers=0, **backbone
) -> dict:
    """Tokenizer, codec, backbone (saved with save_pretrained) and a prepared dataset made from
    synthetic tones (deterministic, no espeak needed), through the real prepare code.
    ``tie=True`` saves the backbone with tie_word_embeddings=True; ``speakers``: item i's
    manifest line names speaker ``s{i % speakers}`` (0: no speaker labels)."""
    import json
    import os

    import numpy as np
    import soundfile as sf

    from torchtitan_speechlm.demo.assets import load_sentences
    from torchtitan_speechlm.prepare.pipeline import prepare_dataset

    paths = tiny_model_assets(root, family=family, seed=seed, tie=tie, **backbone)
    root = str(root)
    sentences = load_sentences()[:n_items]
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "wavs"), exist_ok=True)
    manifest = os.path.join(root, "manifest.jsonl")
    with open(manifest, "w") as f:
        for i, text in enumerate(sentences):
            sr, dur = 16000, 0.3 + 0.02 * len(text.split())
            t = np.arange(int(sr * dur)) / sr
            wav = 0.3 * np.sin(2 * np.pi * (150 + 20 * (i % 7)) * t) + 0.01 * rng.standard_normal(
                len(t)
            )
            path = os.path.join(root, "wavs", f"u{i}.wav")
            sf.write(path, wav.astype(np.float32), sr)
            line = {"id": f"u{i}", "audio": path, "text": text}
            if speakers:
                line["speaker"] = f"s{i % speakers}"
            f.write(json.dumps(line) + "\n")
    prepare_dataset(manifest, paths["codec"], paths["tokenizer"], paths["prepared"], progress=False)
    return paths


TINY_TOML = """
[job]
dump_folder = "{dump}"
custom_config_module = "torchtitan_speechlm.config"
[experimental]
custom_import = "torchtitan_speechlm"
[model]
name = "speechlm"
flavor = "hf"
hf_assets_path = "{backbone}"
[speechlm]
pattern = "delay"
z_loss_weight = 1e-3
[speechlm_data]
datasets = ["tiny={prepared}"]
train = ["tts:tiny:0.5", "asr:tiny:0.5"]
valid = ["asr:tiny"]
[optimizer]
name = "AdamW"
lr = 1e-2
implementation = "foreach"
[lr_scheduler]
warmup_steps = 2
[training]
local_batch_size = 2
seq_len = 160
steps = 6
dtype = "float32"
mixed_precision_param = "float32"
[parallelism]
data_parallel_shard_degree = -1
[checkpoint]
enable = true
interval = 3
last_save_model_only = false
[activation_checkpoint]
mode = "none"
[metrics]
log_freq = 1
enable_tensorboard = false
[validation]
enable = true
freq = 3
local_batch_size = 2
seq_len = 160
"""


def write_tiny_config(path, assets: dict, dump) -> str:
    text = TINY_TOML.format(dump=dump, **assets)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def train_mixture(root, assets: dict, name: str, mixture: list[str], steps: int = 4):
    """The tiny run (config above) trained ``steps`` steps on the task ``mixture`` (e.g.
    ``["tts_prompt:tiny:0.5", "asr:tiny:0.5"]``: a speaker-prompted model, on assets made with
    ``speakers``): ``(its step folder, the run's output)``. A few seconds at 4 steps."""
    import json
    import os

    dump = os.path.join(str(root), name)
    cfg = write_tiny_config(os.path.join(str(root), f"{name}.toml"), assets, dump)
    with open(cfg) as f:
        text = f.read().replace(
            'train = ["tts:tiny:0.5", "asr:tiny:0.5"]', f"train = {json.dumps(mixture)}"
        )
    with open(cfg, "w") as f:
        f.write(text)
    r = run_train(
        cfg,
        "--training.steps", str(steps),
        "--checkpoint.interval", str(steps),
        "--validation.enable", "false",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return os.path.join(dump, "checkpoint", f"step-{steps}"), r.stdout + r.stderr


def tiny_export(
    root, steps: int = 60, n_items: int = 4, fresh: bool = False, pattern: str = "delay",
    **backbone,
) -> dict:  # fmt: skip
    """A tiny model trained ``steps`` steps on ``n_items`` synthetic utterances (the tiny run's
    assets and config above, through `torchtitan train`) and exported with `torchtitan export`:
    ``{"export": DIR, "assets": ..., "step": ...}``. About 15 s on 2 cores at the defaults; 60
    steps are enough for ASR to give words (not the right ones) and TTS to give audio.
    ``fresh``: train in a new process (``run_train``), for callers without the test process's
    ``OMP_NUM_THREADS=1`` (a fork after OpenMP has run can hang). ``pattern``: the interleave
    pattern (``flatten``: N model frames per audio frame, so the sequences are 400 long)."""
    import os

    from torchtitan_speechlm.commands.export import export

    root = str(root)
    assets = make_tiny_run_assets(os.path.join(root, "assets"), n_items=n_items, **backbone)
    config = write_tiny_config(os.path.join(root, "tiny.toml"), assets, os.path.join(root, "run"))
    if pattern != "delay":
        with open(config) as f:
            text = f.read().replace('pattern = "delay"', f'pattern = "{pattern}"')
        if pattern == "flatten":
            text = text.replace("seq_len = 160", "seq_len = 400")
        with open(config, "w") as f:
            f.write(text)
    r = run_train(
        config,
        "--training.steps", str(steps),
        "--checkpoint.interval", str(steps),
        "--validation.enable", "false",
        "--optimizer.weight_decay", "0",
        "--metrics.log_freq", str(steps),
        timeout=600,
        fresh=fresh,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    step = os.path.join(root, "run", "checkpoint", f"step-{steps}")
    out = os.path.join(root, "export")
    export(step, out)
    return {
        "export": out,
        "assets": assets,
        "step": step,
        "manifest": os.path.join(root, "assets", "manifest.jsonl"),
    }


def run_train(config: str, *extra: str, nproc: int = 1, timeout: int = 300, fresh: bool = False):
    """Run `torchtitan train` as a user would; returns the CompletedProcess. By default in a
    fork of the test process (tests/forked.py: the same command without importing everything
    again); ``fresh``: as a new process through the console script's module and torch's
    elastic launcher (for what the launcher itself does)."""
    import os
    import subprocess
    import sys

    from tests import forked

    argv = ["train", "--job.config_file", config, "--nproc-per-node", str(nproc), *extra]
    if not fresh:
        return forked.torchtitan(argv, timeout=timeout)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # wandb: our offline default
    cmd = [
        sys.executable,
        "-m",
        "torchtitan_speechlm.cli",
        "train",
        "--job.config_file",
        config,
        "--nproc-per-node",
        str(nproc),
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def read_metrics(dump) -> list[dict]:
    import json
    import os

    with open(os.path.join(str(dump), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def make_varied_kaldi_assets(root, n_utts=40, seed=0, family="llama", **backbone) -> dict:
    """A corpus unlike the demo's: espeak-ng speech of 1 to 3 sentences (0.4-6 s, texts of 1
    to 40 words), in a Kaldi data dir where some utterances are segments of longer recordings,
    prepared through the real Kaldi reader; a tiny *Llama* backbone (or ``family``'s)."""
    import os
    import random
    import subprocess

    import numpy as np
    import soundfile as sf

    from torchtitan_speechlm.demo.assets import load_sentences
    from torchtitan_speechlm.prepare.pipeline import prepare_dataset
    from torchtitan_speechlm.utils.audio import load_audio

    paths = tiny_model_assets(root, family=family, seed=seed, **backbone)
    root = str(root)
    sentences = load_sentences()
    rng = random.Random(seed)
    kaldi, wavs = os.path.join(root, "kaldi"), os.path.join(root, "kaldi_wavs")
    os.makedirs(kaldi, exist_ok=True)
    os.makedirs(wavs, exist_ok=True)
    scp, text, segments = [], [], []
    for i in range(n_utts):
        words = " ".join(rng.sample(sentences, rng.choice((1, 1, 2, 3)))).split()
        words = words[: rng.choice((1, 2, 4, 8, 16, 40))]
        path = os.path.join(wavs, f"r{i:03d}.wav")
        subprocess.run(
            ["espeak-ng", "-w", path, "-s", str(rng.choice((140, 175, 210))), " ".join(words)],
            check=True,
            capture_output=True,
        )
        wav = load_audio(path, 16000)
        sf.write(path, (0.9 * wav / (np.abs(wav).max() or 1.0)).astype(np.float32), 16000)
        scp.append(f"r{i:03d} {path}")
        if i % 4 == 3 and len(words) >= 4:  # two segments of one recording
            half = len(wav) / 16000 / 2
            segments += [
                f"r{i:03d}-a r{i:03d} 0.00 {half:.2f}",
                f"r{i:03d}-b r{i:03d} {half:.2f} -1",
            ]
            cut = len(words) // 2
            text += [f"r{i:03d}-a {' '.join(words[:cut])}", f"r{i:03d}-b {' '.join(words[cut:])}"]
        else:
            segments.append(f"r{i:03d} r{i:03d} 0.00 -1")
            text.append(f"r{i:03d} {' '.join(words)}")
    for name, lines in (("wav.scp", scp), ("text", text), ("segments", segments)):
        with open(os.path.join(kaldi, name), "w") as f:
            f.write("\n".join(lines) + "\n")
    prepare_dataset(
        None, paths["codec"], paths["tokenizer"], paths["prepared"], kaldi=kaldi, progress=False
    )
    return paths


def spoken_qa_dataset(tmp_path, run, n: int = 6) -> tuple[str, str]:
    """Dialogues ``[user audio] [user text: question] -> [assistant text: answer]`` of the
    tiny run's recordings (spoken QA), prepared with their waveforms; manifest and folder."""
    import json
    import os

    from torchtitan_speechlm.commands.prepare import main as prepare_main

    manifest = str(tmp_path / "qa.jsonl")
    with open(os.path.join(os.path.dirname(run["prepared"]), "manifest.jsonl")) as f:
        speech = [json.loads(line) for line in f][:n]
    with open(manifest, "w") as f:
        for k, r in enumerate(speech):
            question = ("Who?", "Whom?")[k % 2]
            turns = [{"role": "user", "audio": r["audio"]}, {"role": "user", "text": question},
                     {"role": "assistant", "text": r["text"].split()[0]}]  # fmt: skip
            f.write(json.dumps({"id": f"qa{k}", "turns": turns}) + "\n")
    out = str(tmp_path / "qa")
    common = ["--codec", run["codec"], "--tokenizer", run["tokenizer"], "--no-progress"]
    assert (
        prepare_main(["--manifest", manifest, *common, "--out-dir", out, "--waveforms", "16000"])
        == 0
    )
    return manifest, out


HSDP = (
    "--parallelism.data_parallel_replicate_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "2",
)


def random_batch(layout, b=2, t=24, seed=0):
    """Random inputs, targets (each stream in its own vocabulary slice) and loss weights, some
    frames without loss."""
    g = torch.Generator().manual_seed(seed)
    n = layout.num_streams
    inputs = torch.empty(b, t, n, dtype=torch.long)
    targets = torch.empty(b, t, n, dtype=torch.long)
    for k in range(n):
        lo, hi = layout.stream_range(k)
        inputs[..., k] = torch.randint(lo, hi, (b, t), generator=g)
        targets[..., k] = torch.randint(lo, hi, (b, t), generator=g)
    weights = torch.rand(b, t, n, generator=g)
    weights[weights < 0.3] = 0.0
    weights[0, :3] = 0.0  # some frames carry no loss at all
    return inputs, targets, weights


def params(step_dir) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint folder."""
    from torch.distributed.checkpoint import FileSystemReader
    from torchtitan.components.checkpoint import MODEL  # noqa: F401  (torchtitan imported)

    from torchtitan_speechlm.commands.export import load_checkpoint_state

    keys = {
        k
        for k in FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
        if not k.startswith(("optimizer", "lr_scheduler", "dataloader", "train_state"))
    }
    return load_checkpoint_state(str(step_dir), keys)


def make_step_dirs(folder, complete: list[int], partial: list[int]) -> None:
    """Checkpoint folders ``step-N`` as DCP leaves them: complete ones end with ``.metadata``
    (written last), half-written ones (a killed save, an async save in flight) have none."""
    for s in complete + partial:
        d = folder / f"step-{s}"
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x")
        if s in complete:
            (d / ".metadata").write_bytes(b"m")


def packed_row(layout, lengths: list[int], seed: int):
    """[1, sum(lengths), 3] random frames and their positions, restarting at every sample."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    inputs = torch.stack(
        [torch.randint(*layout.stream_range(k), (n,), generator=g) for k in range(3)], -1
    )[None]
    return inputs, torch.cat([torch.arange(m) for m in lengths])[None]


def assert_packed_row_equals_each_sample(model, lengths: list[int], seed: int) -> None:
    """The logits of a row packing samples of ``lengths`` (positions restarting at each) equal
    each sample's logits alone: document attention and per-sample positions."""
    inputs, pos = packed_row(model.args.layout, lengths, seed=seed)
    with torch.no_grad():
        packed = model.logits(inputs, position_ids=pos)
        at = 0
        for n in lengths:
            alone = model.logits(inputs[:, at : at + n])
            for k in range(len(alone)):
                torch.testing.assert_close(
                    packed[k][:, at : at + n], alone[k], atol=1e-5, rtol=1e-5
                )
            at += n


def start_server(export: str, *flags: str, wait_s: float = 180, timeout: float = 120) -> dict:
    """`torchtitan serve --model EXPORT --port 0 FLAGS` in a process of its own (forked from
    this one), once it listens: its URL, an `openai` client on it, its process and its stdout
    lines (the access log's JSON lines among them)."""
    import threading

    import openai

    from tests import forked
    from torchtitan_speechlm import cli

    argv = ["serve", "--model", export, "--port", "0", *flags]
    # a fork of this process (tests/forked.py Process): the console script's own main, without
    # importing torch, transformers and the server again
    proc = forked.Process(["torchtitan", *argv], lambda: cli.main(list(argv)),
                          env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    lines: list[str] = []
    url: list[str] = []
    started = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "torchtitan serve:" in line and " on http://" in line and not url:
                url.append(line.split(" on ")[1].split()[0])
                started.set()
        started.set()

    threading.Thread(target=read, daemon=True).start()
    assert started.wait(wait_s) and url, "\n".join(lines[-30:])
    client = openai.OpenAI(base_url=url[0] + "/v1", api_key="none", max_retries=0, timeout=timeout)
    return {"url": url[0], "client": client, "lines": lines, "proc": proc}


def aborted_in_torch_teardown(stderr: str, last_checkpoint) -> bool:
    """True when a multi-process gloo run failed only in torch's interpreter teardown after it
    completed: a rank's ``terminate called without an active exception`` (SIGABRT) and the
    run's last checkpoint (``last_checkpoint``, a step folder) whole on disk. That is
    patches/0009-gloo-teardown-abort.md (torch, CPU gloo only): ``torchtitan train`` leaves with
    ``os._exit``, but a Python API run (ESPnet's ``bin/train.py`` calling ``TitanTrainer``)
    cannot, and docs/python-api.md says so. Any other failure, or this one before the last
    checkpoint, is not this."""
    done = os.path.join(str(last_checkpoint), ".metadata")
    return "terminate called without an active exception" in stderr and os.path.isfile(done)
