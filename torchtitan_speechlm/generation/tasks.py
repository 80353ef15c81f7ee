"""The generation tasks on a loaded model: text -> speech, speech -> text, speech continuation.

Prompts are built with the training template (``TemplateBuilder.prefix``), so generation sees
exactly what training did: ``<bos><|user|><|text|> text <|eot|><|assistant|><|audio|>`` for TTS,
``<bos><|user|><|audio|> prompt codes <|eot|><|user|><|text|> text <|eot|><|assistant|><|audio|>``
for TTS with a speaker prompt (``tts_prompt``'s template; the prompt cut as training cut it),
``<bos><|user|><|audio|> codes <|eot|><|assistant|><|text|>`` for ASR, and ``<bos><|assistant|>
<|audio|>`` followed by the prompt's own codes for a continuation. For TTS guidance the
unconditional prompt replaces the text by ``<|cfg_drop|>``, as CFG dropout did in training
(a speaker prompt stays: training dropped only the text).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from torchtitan_speechlm.data.format import to_int16
from torchtitan_speechlm.data.tasks import continuous_turn
from torchtitan_speechlm.data.template_pieces import Segment
from torchtitan_speechlm.generation import best_of
from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder, Joining
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.utils.audio import load_audio

TASKS = ("tts", "asr", "continuation", "answer")
FramesCallback = Callable[[int, np.ndarray], None]  # Decoder.audio's on_frames
StopCheck = Callable[[int], bool]  # Decoder's stop: end row i now


def text_ids(loaded: Loaded, text: str) -> np.ndarray:
    if not text or not text.strip():
        raise ValueError("the text to speak is empty")
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    if max(ids, default=0) >= loaded.layout.text_size:
        raise ValueError("the tokenizer gives ids outside the model's text vocabulary")
    return np.asarray(ids, dtype=np.int64)


def audio_codes(loaded: Loaded, wav_path: str) -> np.ndarray:
    """A wav (any rate, any channels: resampled and downmixed) as codes [F, N]."""
    codec = loaded.codec
    return codec.encode([load_audio(wav_path, codec.sample_rate)])[0]


def tts(loaded: Loaded, texts: list[str], cfg: DecodeConfig) -> list[np.ndarray]:
    """Codes [F, N] spoken for each text."""
    return tts_with_ends(loaded, texts, cfg)[0]


class PromptRefused(ValueError):
    """A speaker prompt asked of a model trained without the prompted task."""


def check_prompted(loaded: Loaded, what: str = "--prompt") -> None:
    """Refuse a speaker prompt to a model trained without ``tts_prompt``, saying why; ``what``
    names the prompt as the caller took it (``--prompt``; serve's ``--voices``,
    ``prompt_audio``), so that the reason says what to drop."""
    if loaded.max_prompt_frames <= 0:
        raise PromptRefused(
            f"{loaded.source} was trained without speaker prompts (its training mixture had "
            "no tts_prompt task, so its model args record prompt_seconds = 0): it cannot "
            f"take {what}; drop {what}, or train with tts_prompt:NAME on a dataset with "
            "speaker labels"
        )


def speaker_prompt(
    loaded: Loaded, wave: np.ndarray, name: str = "the prompt", what: str = "--prompt"
) -> np.ndarray:
    """A speaker prompt's codes [F, N] from a waveform at the codec's rate, cut to the model's
    ``prompt_seconds`` as training cut its prompts (a line on stderr says so). ``what``:
    ``check_prompted``'s."""
    import sys

    check_prompted(loaded, what)
    codes = loaded.codec.encode([wave])[0]
    cut = loaded.max_prompt_frames
    if len(codes) > cut:
        seconds = len(wave) / loaded.codec.sample_rate
        print(
            f"{name}: {seconds:.2f} s, cut to its first {loaded.prompt_seconds:g} s "
            "(the model's prompt_seconds)",
            file=sys.stderr,
        )
    return loaded.builder.cut_prompt(codes)


def tts_with_ends(
    loaded: Loaded,
    texts: list[str],
    cfg: DecodeConfig,
    seeds: list[int] | None = None,
    on_frames: FramesCallback | None = None,
    prompts_codes: list[np.ndarray | None] | None = None,
    stop: StopCheck | None = None,
    join: Callable[[int], list[Joining]] | None = None,
    on_done: Callable[[int, np.ndarray, bool], None] | None = None,
) -> tuple[list[np.ndarray], list[bool]]:
    """``tts`` plus, per text, whether the model ended the speech itself (False: the
    ``max_frames`` limit cut it), which evaluation reports as the end-of-speech rate.
    ``seeds`` and ``on_frames``: ``Decoder.audio``'s (per-row seeds; streaming); ``stop``:
    ``Decoder``'s (rows ended between steps, a server's cancelled requests).
    ``prompts_codes``: per text, a speaker prompt's codes (``speaker_prompt``; None: none),
    laid out as ``tts_prompt`` trained. With ``cfg.best_of`` N > 1, each text's N samples
    are decoded in one batch and the one the model's own ASR reads back best is kept
    (generation/best_of.py); ``on_frames`` then gets each kept rendition whole, once chosen.
    ``join`` and ``on_done``: ``Decoder.audio``'s (rows joining the batch in progress, made by
    ``tts_joining``; each row's codes as soon as it is complete); not with best-of-N."""
    if cfg.best_of > 1:
        if join is not None or on_done is not None:
            raise ValueError("tts_with_ends: join / on_done with best_of > 1")
        return _tts_best_of(loaded, texts, cfg, seeds, on_frames, prompts_codes, stop)
    speakers = prompts_codes or [None] * len(texts)
    prompts = tts_prompts(loaded, texts, speakers)
    uncond = [_uncond(loaded, p) for p in speakers] if cfg.cfg_scale != 1.0 else None
    decoder = Decoder(loaded.model, cfg, stop)
    codes = decoder.audio(
        fit_context(loaded, prompts),
        uncond,
        seeds=seeds,
        on_frames=on_frames,
        join=join,
        on_done=on_done,
    )
    return codes, decoder.ended


def tts_joining(
    loaded: Loaded, text: str, cfg: DecodeConfig, speaker: np.ndarray | None = None
) -> Joining:
    """One text's row for ``tts_with_ends``'s ``join``: its prompt as ``tts_with_ends`` makes
    it (checked the same way: ValueError for a prompt the context cannot hold)."""
    prompt = fit_context(loaded, tts_prompts(loaded, [text], [speaker]))[0]
    return Joining(prompt, _uncond(loaded, speaker) if cfg.cfg_scale != 1.0 else None)


def _uncond(loaded: Loaded, speaker: np.ndarray | None) -> np.ndarray:
    """The unconditional twin of a TTS prompt (classifier-free guidance): the text dropped."""
    drop = np.array([loaded.layout.special("<|cfg_drop|>") - loaded.layout.text_offset])
    return loaded.builder.prefix(_tts_turns(loaded, drop, speaker), "assistant", "audio")


def _tts_best_of(loaded, texts, cfg, seeds, on_frames, prompts_codes, stop):
    """``tts_with_ends`` with ``cfg.best_of`` N > 1: every text's N candidates (candidate k
    drawing with the text's seed + k) decoded together, each transcribed by the model, the
    best kept (``best_of.choose``). A model that hears speech through its audio encoder was
    not trained to read codes, so its transcripts of codes would rank nothing: refused."""
    if loaded.model.args.audio is not None:
        raise ValueError(
            "--best-of ranks renditions by the model's ASR of their codes, and this model reads "
            "speech through its audio encoder (docs/audio-encoder.md); drop --best-of"
        )
    n, one = cfg.best_of, replace(cfg, best_of=1)
    row_stop = None if stop is None else (lambda r: stop(r // n))
    codes, ended = tts_with_ends(
        loaded,
        best_of.candidate_rows(texts, n),
        one,
        best_of.candidate_seeds(seeds or [cfg.seed] * len(texts), n),
        prompts_codes=None if prompts_codes is None else best_of.candidate_rows(prompts_codes, n),
        stop=row_stop,
    )
    spoken = [r for r, c in enumerate(codes) if len(c)]
    transcripts: list[str | None] = [None] * len(codes)
    for r, text in zip(spoken, asr(loaded, [codes[r] for r in spoken], one), strict=True):
        transcripts[r] = text
    picks = best_of.choose(texts, transcripts, ended, n)
    if on_frames is not None:
        for i, r in enumerate(picks):
            if len(codes[r]):
                on_frames(i, codes[r])
    return [codes[r] for r in picks], [ended[r] for r in picks]


def _tts_turns(loaded: Loaded, text: np.ndarray, speaker) -> list[Segment]:
    b = loaded.builder
    head = [] if speaker is None else [Segment("user", "audio", b.cut_prompt(speaker))]
    return head + [Segment("user", "text", text)]


def tts_prompts(
    loaded: Loaded, texts: list[str], speakers: list[np.ndarray | None] | None = None
) -> list[np.ndarray]:
    """The TTS prompts ([T, N] frames of the training template, ending ``<|audio|>``) of each
    text, with its speaker prompt's codes where given (checked: ``check_prompted``)."""
    speakers = speakers or [None] * len(texts)
    if any(p is not None for p in speakers):
        check_prompted(loaded)
    return [
        loaded.builder.prefix(_tts_turns(loaded, text_ids(loaded, t), p), "assistant", "audio")
        for t, p in zip(texts, speakers, strict=True)
    ]


def asr_prompts(loaded: Loaded, codes: list[np.ndarray]) -> list[np.ndarray]:
    """The ASR prompts ([T, N] frames, ending ``<|text|>``) of each utterance's codes."""
    b = loaded.builder
    return [b.prefix([Segment("user", "audio", c)], "assistant", "text") for c in codes]


def asr(
    loaded: Loaded,
    codes: list[np.ndarray],
    cfg: DecodeConfig,
    seeds: list[int] | None = None,
    stop: StopCheck | None = None,
) -> list[str]:
    """The transcript of each utterance's codes."""
    prompts = asr_prompts(loaded, codes)
    ids = Decoder(loaded.model, cfg, stop).text(fit_context(loaded, prompts), seeds=seeds)
    return [loaded.tokenizer.decode(i) for i in ids]


def asr_wave(
    loaded: Loaded,
    waves: list[np.ndarray],
    cfg: DecodeConfig,
    seeds: list[int] | None = None,
    stop: StopCheck | None = None,
) -> list[str]:
    """The transcript of each waveform (float, or int16 as stored, at the audio encoder's rate)
    through the model's continuous audio encoder (the ``asr_wave`` template)."""
    waves = [w if w.dtype == np.int16 else to_int16(w) for w in waves]
    pairs = [loaded.builder.continuous_prefix(w, "assistant", "text") for w in waves]
    prompts = fit_context(loaded, [p for p, _ in pairs])
    ids = Decoder(loaded.model, cfg, stop).text(prompts, [a for _, a in pairs], seeds=seeds)
    return [loaded.tokenizer.decode(i) for i in ids]


def input_rate(loaded: Loaded) -> int:
    """The rate a task's input audio is read at: the audio encoder's, else the codec's."""
    encoder = loaded.model.args.audio
    return int(encoder.sample_rate if encoder is not None else loaded.codec.sample_rate)


def transcribe_waves(
    loaded: Loaded,
    waves: list[np.ndarray],
    cfg: DecodeConfig,
    seeds: list[int] | None = None,
    stop: StopCheck | None = None,
) -> list[str]:
    """``generate --task asr`` on waveforms at ``input_rate``: through the model's continuous
    audio encoder when it has one (docs/audio-encoder.md), else as the data codec's codes."""
    if loaded.model.args.audio is not None:
        return asr_wave(loaded, waves, cfg, seeds, stop)
    return asr(loaded, loaded.codec.encode(waves), cfg, seeds, stop)


def transcribe_items(loaded: Loaded, items: list, cfg: DecodeConfig) -> list[str]:
    """The model's transcripts of prepared items (``eval``'s ASR): their waveforms through the
    audio encoder when the model has one, else their codes."""
    if loaded.model.args.audio is None:
        return asr(loaded, [it.audio_codes for it in items], cfg)
    if any(getattr(it, "wave", None) is None for it in items):
        raise ValueError(
            "the model reads audio through its encoder and these items carry no waveforms; "
            "add them: python -m torchtitan_speechlm.prepare.waveforms PREPARED MANIFEST"
        )
    return asr_wave(loaded, [it.wave for it in items], cfg)


def question_turns(item, continuous: bool = False) -> list[Segment]:
    """A dialogue item's turns before its answer: the last turn, which must be assistant
    text (the answer ``eval`` scores). ``continuous``: the audio turn is the item's waveform
    (task ``dialogue_wave``), else its codes."""
    turns = getattr(item, "turns", None) or []
    if not turns or (turns[-1].role, turns[-1].modality) != ("assistant", "text"):
        raise ValueError(
            f"dialogue {item.id!r}: an answer set's dialogues end in an assistant text turn "
            "(the answer to score)"
        )
    segs = [Segment(t.role, t.modality, t.tokens) for t in turns[:-1]]
    return continuous_turn(segs, item, "dialogue_wave") if continuous else segs


def reference_answer(item) -> str:
    question_turns(item)  # the checks
    return item.turns[-1].text


def answer_items(loaded: Loaded, items: list, cfg: DecodeConfig) -> list[str]:
    """The model's answer to each dialogue (``eval``'s dialogue sets): its last turn, assistant
    text, generated after the turns before it. Audio turns are read as the item's waveform
    through the audio encoder when the model has one (task ``dialogue_wave``), else as codes
    (task ``dialogue``)."""
    continuous = loaded.model.args.audio is not None
    prompts, audio = [], []
    for it in items:
        segs = question_turns(it, continuous)
        frames, waves = loaded.builder.prompt(segs, "assistant", "text", continuous)
        prompts.append(frames)
        audio.append(waves)
    ids = Decoder(loaded.model, cfg).text(fit_context(loaded, prompts), audio)
    return [loaded.tokenizer.decode(i) for i in ids]


def answers(
    loaded: Loaded,
    questions: list[tuple[np.ndarray, str | None]],
    cfg: DecodeConfig,
    seeds: list[int] | None = None,
) -> list[str]:
    """``generate --task answer``: the text answer to each spoken question (a waveform at
    ``input_rate`` and an optional instruction; the dialogue layout ``[user audio] [user text:
    instruction] -> [assistant text]``); the audio read through the model's audio encoder when
    it has one, else as the data codec's codes."""
    encoder = loaded.model.args.audio is not None
    prompts, audio = [], []
    for wave, instruction in questions:
        heard = to_int16(wave) if encoder else loaded.codec.encode([wave])[0]
        segs = [Segment("user", "audio", heard)]
        if instruction:
            segs.append(Segment("user", "text", text_ids(loaded, instruction)))
        frames, waves = loaded.builder.prompt(segs, "assistant", "text", encoder)
        prompts.append(frames)
        audio.append(waves)
    ids = Decoder(loaded.model, cfg).text(fit_context(loaded, prompts), audio, seeds=seeds)
    return [loaded.tokenizer.decode(i) for i in ids]


def answer(loaded: Loaded, wav_path: str, instruction: str | None, cfg: DecodeConfig) -> str:
    """``answers`` of one wav file (any rate, any channels)."""
    return answers(loaded, [(load_audio(wav_path, input_rate(loaded)), instruction)], cfg)[0]


def transcribe(loaded: Loaded, wav_path: str, cfg: DecodeConfig) -> str:
    """``transcribe_waves`` of one wav file (any rate, any channels)."""
    return transcribe_waves(loaded, [load_audio(wav_path, input_rate(loaded))], cfg)[0]


def continuation(
    loaded: Loaded,
    codes: list[np.ndarray],
    cfg: DecodeConfig,
    seeds: list[int] | None = None,
    on_frames: FramesCallback | None = None,
) -> list[np.ndarray]:
    """Each prompt's codes continued (the result starts with the prompt)."""
    prompt = loaded.builder.prefix([], "assistant", "audio")
    return Decoder(loaded.model, cfg).audio(
        fit_context(loaded, [prompt] * len(codes)), known=list(codes), seeds=seeds,
        on_frames=on_frames,
    )  # fmt: skip


def max_input_seconds(loaded: Loaded) -> float | None:
    """The longest input audio whose transcription prompt fits the backbone's context, in
    seconds (None: the backbone names no context), so that a server refuses longer uploads
    before the model worker encodes them (``fit_context`` would refuse them there). The prompt
    grows linearly with the audio: its lengths at two sizes give the slope."""
    ctx = int(loaded.model.args.backbone_config.get("max_position_embeddings") or 0)
    if not ctx:
        return None
    if loaded.model.args.audio is not None:  # continuous: per second of the encoder's input
        rate = input_rate(loaded)

        def length(k: int) -> int:
            wave = np.zeros(k * rate, dtype=np.int16)
            return len(loaded.builder.continuous_prefix(wave, "assistant", "text")[0])

        unit = 1.0
    else:  # codes: per codec frame
        n = loaded.layout.num_streams

        def length(k: int) -> int:
            return len(asr_prompts(loaded, [np.zeros((k, n), dtype=np.int64)])[0])

        unit = loaded.codec.samples_per_frame / loaded.codec.sample_rate
    one, slope = length(1), length(2) - length(1)
    if slope <= 0:
        return None
    return max(0, (ctx - 2 - one) // slope + 1) * unit


def fit_context(loaded: Loaded, prompts: list[np.ndarray]) -> list[np.ndarray]:
    """Refuse (ValueError) a prompt that leaves no room in the backbone's context."""
    ctx = int(loaded.model.args.backbone_config.get("max_position_embeddings") or 0)
    for p in prompts:
        if ctx and len(p) + 2 > ctx:
            raise ValueError(
                f"the prompt takes {len(p)} frames but the model's context is {ctx}; "
                "use a shorter text or audio"
            )
    return prompts


def make_parent_folder(path: str) -> None:
    """Create the folder an output file goes in (``--out new/dir/out.wav``), as a user expects:
    soundfile would otherwise end in a bare ``LibsndfileError: System error``. Raises OSError
    naming the path when it cannot (a parent is a file, no permission) or ``path`` is a folder."""
    import os

    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise IsADirectoryError(f"cannot write {path}: it is a folder; give a file name")
    existing = os.path.dirname(full)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(
            f"cannot write {path}: its folder cannot be created because {existing} is a file"
        )
    try:
        os.makedirs(os.path.dirname(full), exist_ok=True)
    except OSError as e:
        raise OSError(
            f"cannot write {path}: its folder cannot be created ({e.strerror or e})"
        ) from None


def decode_audio(loaded: Loaded, codes: list[np.ndarray]) -> list[np.ndarray]:
    """Waveforms of codes [F, N] each, decoded together by a codec with ``decode_batch``, one
    by one without (a registered codec need only have ``decode``)."""
    batch = getattr(loaded.codec, "decode_batch", None)
    if batch is None or not codes:
        return [loaded.codec.decode(c) for c in codes]
    return batch(codes)


def write_wav(loaded: Loaded, codes: np.ndarray, path: str, wav: np.ndarray | None = None) -> int:
    """Decode codes with the data's codec (unless ``wav`` is their decoded audio already) and
    write a wav at its rate (its folder created if missing); returns samples. Raises OSError
    naming ``path`` if it cannot be written."""
    import soundfile as sf

    make_parent_folder(path)
    wav = loaded.codec.decode(codes) if wav is None else wav
    try:
        sf.write(path, wav, loaded.codec.sample_rate)
    except RuntimeError as e:  # soundfile's LibsndfileError: "System error" and the like
        raise OSError(f"cannot write {path}: {e}") from None
    return len(wav)
