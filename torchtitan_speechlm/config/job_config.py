"""The TOML schema of the SpeechLM sections: ``[speechlm]``, ``[speechlm_data]``,
``[speechlm_faults]``, ``[lora]``, ``[audio_encoder]`` and a changed ``[checkpoint]`` default, as
dataclasses torchtitan's ConfigManager merges into its JobConfig (``job.custom_config_module =
"torchtitan_speechlm.config"``). Each field's docstring is its documentation (docs/config.md is
generated from them by tools/config_doc.py).

Only the schema lives here: a value's range is checked by the layer that uses it (the data
stream its batching keys, the loss head its weights, the step guard ``[speechlm_faults]``, the
audio tower ``[audio_encoder]``), and keys that must agree with each other or with the data by
the run plan (trainer/plan.py).
"""

from dataclasses import dataclass, field
from typing import Literal

# Allowed values typed once: modules that act on them derive their tuples with get_args.
Batching = Literal["pack", "bucket"]
OrderName = Literal["auto", "keyed", "permutation"]  # the first: the default
LossRegion = Literal["assistant", "all"]
ChatTemplate = Literal["ours", "espnet"]


@dataclass
class SpeechLM:
    """[speechlm]: model, vocabulary and loss."""

    init: Literal["pretrained", "normal"] = "pretrained"
    """`pretrained`: copy the backbone folder's weights (`model.hf_assets_path`; a folder with
    only config.json is a random init); `normal`: every weight drawn anew (norms 1, biases 0,
    others N(0, `init_std`)), identical on every rank (a pure function of `init_seed` and the
    parameter's name)."""
    init_std: float = 0.0
    """Standard deviation of the normal init; 0 = the backbone's `initializer_range`."""
    init_from: str = ""
    """Start from these weights instead (applied last): a `torchtitan export` folder, another
    run's checkpoint `DUMP/checkpoint/step-N` (weights only), or a `.pt` state dict (ESPnet's
    `{"module": ...}` too). Refused if made with another vocabulary, pattern, backbone or
    codec (see checkpoints.md)."""
    init_from_map: list[str] = field(default_factory=list)
    """`SRC_PREFIX=DST_PREFIX` renames of the `init_from` names (first match wins)."""
    init_from_allow_missing: list[str] = field(default_factory=list)
    """Name prefixes of our parameters that `init_from` may lack (they keep their init)."""
    init_from_allow_unexpected: list[str] = field(default_factory=list)
    """Name prefixes of `init_from` tensors to ignore."""
    weight_decay_exclude: list[str] = field(
        default_factory=lambda: ["embeddings", "norms", "biases"]
    )
    """Parameters without weight decay: `embeddings` (token embeddings, stream offsets, a tied
    head), `norms` (1-D norm weights), `biases`, or shell patterns over parameter names
    (`backbone.layers.0.*`). Empty = decay everything (torchtitan's default)."""
    pattern: str = "delay"
    """Audio interleave pattern, a registered one: `delay` (stream n shifted by n frames),
    `parallel` (aligned), `flatten` (every codebook serialised into stream 0, Orpheus/Llasa
    style)."""
    chat_template: ChatTemplate = "ours"
    """How a turn ends when another follows it: `ours` `<|eot|>` always; `espnet` `<|eot|>`
    when the next turn has the same role, else `<|eos|>` (ESPnet's SpeechLMPreprocessor;
    `TitanTrainer` sets it for ESPnet's data). Recorded with the model, so eval, generate and
    serve prompt it the way it was trained. The last turn ends with `<|eos|>` in both."""
    tie_embeddings: Literal["auto", "true", "false"] = "auto"
    """Tie the output head to the input embedding (`auto` = the backbone's
    `tie_word_embeddings`)."""
    attn_implementation: str = "sdpa_documents"
    """Attention: `sdpa_documents` (default; CPU and GPU) runs each packed row's documents as
    separate causal sequences inside SDPA, with no [B, 1, T, T] mask; any transformers
    implementation (`sdpa`: dense block mask; `flash_attention_2` on GPUs: varlen); `flex`
    with the native backbone (GPU)."""
    init_seed: int = 0
    """Seed of the deterministic, world-size-invariant initialisation of new parameters."""
    text_weight: float = 1.0
    """Loss weight of text / special targets (stream 0)."""
    audio_weight: float = 1.0
    """Loss weight of one audio frame, split over streams by `stream_weights`."""
    stream_weights: list[float] = field(default_factory=list)
    """Per-stream audio weights (normalised to sum 1); empty = uniform."""
    z_loss_weight: float = 0.0
    """Weight of the z-loss term (logsumexp²); 0 disables it."""
    load_balance_weight: float = 0.0
    """Weight of the MoE load-balance loss (MoE backbones only)."""
    loss_chunk_size: int = 4096
    """Most positions per logits chunk of one stream (each chunk's gradient is computed while
    its logits exist, then they are freed: logits are never all held at once)."""
    loss_chunk_mb: float = 256.0
    """Memory bound of one chunk's fp32 logits: a stream with a large vocabulary (the text
    stream of a 150k tokenizer) takes chunks of fewer positions."""
    code_usage_interval: int = 100
    """Log per-stream codebook usage and perplexity at steps divisible by this (0 = never)."""
    sample_every: int = -1
    """Decode a small prompt set every this many steps (written under {dump_folder}/samples/,
    logged as audio and text panels); -1 = at each validation with a GPU, never on CPU;
    0 = never."""
    sample_count: int = 2
    """Prompts of the sample set: the first speech items of the first validation set."""
    sample_texts: list[str] = field(default_factory=list)
    """TTS texts of the sample set instead of those items' texts."""
    freeze: list[str] = field(default_factory=list)
    """Parameter-name prefixes to freeze (e.g. `backbone.layers.0`); each must match a
    parameter."""
    preference_loss: Literal["", "dpo", "simpo"] = ""
    """Preference training (docs/preference.md): the loss of the `*_pref` tasks' chosen /
    rejected pairs. `dpo`: against the run's starting weights as the frozen reference (their
    log-probs of every pair computed once, before step 1, into
    `{dump_folder}/preference_reference/`); `simpo`: reference-free, length-normalised. Empty:
    no preference training (a mixture with `*_pref` tasks then is refused)."""
    preference_beta: float | None = None
    """The preference loss's beta (> 0); unset: the loss's usual value (DPO 0.1, as TRL and
    ESPnet's DPO recipe; SimPO 2.0, as the SimPO authors)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (>= 0)."""
    preference_label_smoothing: float = 0.0
    """Conservative label smoothing of the preference loss (cDPO), in [0, 0.5)."""
    preference_nll_weight: float = 0.0
    """Adds this times the chosen answer's negative log-likelihood per loss token to each
    pair's loss (RPO; TRL's "sft" loss term), >= 0: the chosen answer itself is learnt too."""
    prompt_seconds: float = 3.0
    """Speaker prompts of the `tts_prompt` task (another utterance of the item's speaker) and
    of `generate --prompt` are cut to their first this many seconds; read only when the
    training mixture has a prompted task (the model then records it)."""


@dataclass
class SpeechLMData:
    """[speechlm_data]: datasets, mixture and batching."""

    datasets: list[str] = field(default_factory=list)
    """Prepared datasets as `NAME=PATH` (made by `torchtitan prepare`, see data.md)."""
    train: list[str] = field(default_factory=list)
    """Training mixture as `TASK:NAME[:WEIGHT]`; TASK a registered task (`tts`, `asr`,
    `continuation`, `text`, `dialogue`, or one of yours)."""
    valid: list[str] = field(default_factory=list)
    """Validation sets as `TASK:NAME` or `SET=TASK:NAME`; logged as `val/{SET}/*` (SET
    defaults to `{TASK}_{NAME}`). A dataset that
    training also uses is validated on its held-out part (`valid_fraction` > 0), never on
    items training sees; with `valid_fraction = 0` it is validated on all its items (a warning
    says they overlap the training data). A dataset training does not use: all its items."""
    valid_fraction: float = 0.0
    """Hold out this fraction of each training dataset's items (by id hash) from training.
    With `valid` empty, every training entry is validated on its held-out part
    (`val/{TASK}_{NAME}_heldout/*`)."""
    seed: int = 0
    """Data order seed (the order is a pure function of it)."""
    shuffle: bool = True
    """Shuffle items (per epoch) and rows / micro-batches (per window) in training;
    validation never shuffles."""
    order: OrderName = "auto"
    """How an epoch orders each source's items. `keyed`: a keyed bijection evaluated only at
    the positions a rank reads (data/keyed_order.py): the same start-up at any corpus size.
    `permutation`: numpy's Fisher-Yates shuffle per epoch, the order of runs before stream
    version 2 (O(items) time and memory on every rank before its first batch: ~0.4 s and 40 MB
    per 10^7 items and source). `auto`: `keyed` for a new run; a resumed run continues in the
    order its checkpoint was cut with (said in the log). An explicit value that differs from
    the checkpoint's is refused."""
    batching: Batching = "pack"
    """`pack`: several samples per row of `training.seq_len` frames, document-masked;
    `bucket`: one sample per row, length-sorted within a window, padded to the longest."""
    max_tokens: int = 0
    """`bucket` only: frames (rows × padded length) per rank per micro-batch; 0 =
    `local_batch_size × seq_len`. With `pack` a micro-batch is always `local_batch_size` rows
    of `seq_len` (setting `max_tokens` there is an error)."""
    window: int = 256
    """Items drawn per packing/bucketing window (larger: less padding; same determinism)."""
    max_too_long_fraction: float = 0.25
    """Stop before the first step if more than this fraction of a training entry's samples
    are longer than `training.seq_len` (they would be skipped); the error names the `seq_len`
    that keeps 99% and all of them. 1.0 = stop only if no sample fits."""
    loss_region: LossRegion = "assistant"
    """Which turns carry loss: the task's loss roles (assistant turns), or every frame after
    `<bos>`."""
    cfg_dropout: float = 0.0
    """TTS classifier-free-guidance dropout: probability of replacing the text prompt by
    `<|cfg_drop|>` (training only)."""
    verify_shards: Literal["full", "size", "none"] = "full"
    """What is checked when training opens a prepared dataset, against the file sizes and
    sha256s `torchtitan prepare` recorded in metadata.json: `full` (a shard modified after
    preparation is refused; reads each shard once per process at start, about 1 s per GB),
    `size` (truncated or appended files only: instant, for very large datasets), `none`."""
    remote_cache_dir: str = ""
    """Where datasets given as URLs (`NAME=s3://bucket/path`, any fsspec URL) are mirrored:
    their index files, and the shards' arrays as ranks read them (data.md, *Object storage*).
    "" = `~/.cache/torchtitan_speechlm/remote`. Node-local disk: the ranks of a node share it."""
    remote_cache_gb: float = 100.0
    """The shard arrays a mirrored dataset keeps on local disk, in GiB; the shards read least
    recently are deleted first (never one a rank has open)."""
    allow_lossy_tokenizer: bool = False
    """Train on datasets whose text tokenizer does not give back their texts (a warning instead
    of the error). Before any rank starts, the stored ids of up to 200 items per dataset,
    spread over it, are decoded with the dataset's tokenizer and compared with the stored
    texts, whitespace runs aside: a tokenizer that loses spaces or characters (a `Whitespace`
    pre-tokenizer with a plain BPE decoder) would make every generated text come back the
    same way (data.md, *Tokenizer requirements*)."""
    log_batch_hashes: bool = False
    """Write a content hash of every consumed micro-batch, and of each sample in it, to
    `{dump_folder}/batch_hashes/rank{r}.jsonl` (`{"hash": ..., "samples": [...]}`, one line
    per micro-batch in the order trained)."""
    step_codec: str = ""
    """A codec folder of ours (k-means, Encodec, Mimi, DAC, ...) that tokenises, in the training
    step on the run's device, the waveforms a Python data object hands for its discrete audio
    (ESPnet's iterator through `EspnetData`: zeros in `seqs`, the audio in `conti_feats`), its
    codes laid out in that data's stream intervals. "" = the data's own tokenizer (ESPnet's io
    `encode_batch`). Checked at start against the data's vocabulary: streams, codebook size,
    frame rate (python-api.md)."""


NonFinitePolicy = Literal["skip", "stop"]


@dataclass
class SpeechLMFaults:
    """[speechlm_faults]: what a bad step does (docs/errors.md)."""

    nonfinite: NonFinitePolicy = "skip"
    """A NaN/Inf loss or gradient, caught before the optimizer step: `skip` the step (no
    update; counted as `reliability/skipped_steps`, logged with the batch's sample ids and
    written to `{dump_folder}/anomalies.jsonl`) or `stop` with an error naming the step and
    the samples. The LR schedule still advances with the step number."""
    max_consecutive_skips: int = 5
    """With `skip`: stop after this many non-finite steps in a row (the model is broken, not
    the batch)."""
    loss_spike_factor: float = 5.0
    """Log a step whose loss exceeds this many times the running median (with its sample
    ids, also to anomalies.jsonl); the step is trained. 0 = off."""
    loss_spike_window: int = 50
    """Steps in the running median of `loss_spike_factor` (spikes are looked for once 5
    steps are in it)."""


@dataclass
class Checkpoint:
    """[checkpoint]: a changed torchtitan default (merged into torchtitan's section)."""

    last_save_model_only: bool = False
    """torchtitan's default is `true` (the last checkpoint holds weights only, so a rerun
    with a larger `training.steps` could not continue). Ours saves the last step in full.
    With `true`, a rerun resumes from the newest *full* checkpoint before it, with a warning
    naming both."""


@dataclass
class LRScheduler:
    """[lr_scheduler]: one key added to torchtitan's section."""

    warmup_from_zero: bool = False
    """The first step's learning rate is 0 and step s of the warmup has `s / warmup_steps` of
    the peak (ESPnet's `lambda(0) = 0`; `TitanTrainer` sets it). torchtitan's default gives the
    first step `1 / warmup_steps` of the peak. The decay after the warmup is the same."""


@dataclass
class Metrics:
    """[metrics]: one key added to torchtitan's section."""

    espnet_keys: bool = False
    """Also log ESPnet TitanTrainer's keys beside ours: `train/lr`, `train/grad_norm` and
    `time/iter` (seconds per step), so its dashboards read a run of ours (`TitanTrainer` sets
    it). Our step s is ESPnet's step s - 1."""


@dataclass
class AudioEncoderConfig:
    """[audio_encoder]: a continuous speech encoder in front of the LM; its adaptor's outputs
    replace the input embeddings of continuous audio segments (docs/audio-encoder.md)."""

    path: str = ""
    """A local transformers folder holding an audio encoder (`model_type` `whisper`: its
    encoder; `qwen2_audio`: its audio tower); empty: no continuous audio input."""
    stack: int = 4
    """Encoder frames the adaptor stacks into one LM frame (Whisper's 50 frames/s become
    12.5 LM frames/s at 4)."""
    adaptor_hidden: int = 0
    """Width of the adaptor's hidden layer; 0: the backbone's hidden size."""
    freeze_encoder: bool = True
    """Keep the encoder's weights as loaded; `false` trains them with the LM."""
    freeze_adaptor: bool = False
    """Keep the adaptor at its initial weights (e.g. one taken over with `speechlm.init_from`)."""


@dataclass
class Lora:
    """[lora]: LoRA fine-tuning (PEFT's LoRA layers), applied when `model.converters` lists
    `"lora"` (docs/checkpoints.md, Parameter-efficient fine-tuning)."""

    rank: int = 8
    """The adapters' rank r."""
    alpha: float = 16.0
    """LoRA's alpha: the adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input (PEFT's lora_dropout)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """The decoder's linear layers that get adapters: `"all-linear"`, or names PEFT's way (a
    module's name or its last parts: `q_proj`, `self_attn.v_proj`, `layers.0.mlp.up_proj`; the
    `native` backbone's are `attention.wq` ... `feed_forward.w3`). Every other weight is frozen."""
    train_audio_rows: bool = True
    """Train the rows the SpeechLM added to the text vocabulary (special tokens and the
    codebooks' codes) in the embedding and the head, and the per-stream head offsets; the text
    rows stay as loaded. `false`: only the adapters (and the head, below) train."""
    train_head: bool = False
    """Train the whole output head, text rows too (tied embeddings: the whole shared table)."""


@dataclass
class JobConfig:
    speechlm: SpeechLM = field(default_factory=SpeechLM)
    lora: Lora = field(default_factory=Lora)
    speechlm_data: SpeechLMData = field(default_factory=SpeechLMData)
    speechlm_faults: SpeechLMFaults = field(default_factory=SpeechLMFaults)
    audio_encoder: AudioEncoderConfig = field(default_factory=AudioEncoderConfig)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
