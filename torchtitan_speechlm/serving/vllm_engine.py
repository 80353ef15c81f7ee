"""``torchtitan serve --engine vllm``: the model worker's ``tts`` and ``asr`` runners (the
``Runner`` of serving/batcher.py, as serving/speech.py's) with the model on a vLLM
OpenAI-compatible server (docs/serving.md, docs/vllm.md).

Only a ``flatten`` model runs there: written as a plain causal LM over its extended vocabulary
(generation/vllm_export.py), one token per step, our decoder's masks applied by vLLM through the
``FlattenAudioMask`` logits processor (generation/vllm_plugin/speechlm_vllm_mask.py). Everything
else stays here, as our engine does it: the prompts (the training template's stream 0, speaker
prompts included: ``tasks.tts_prompts`` / ``tasks.asr_prompts``), the codec (encoding uploads,
decoding codes: ``tasks.decode_audio``; streamed rows through ``AudioStream``), the tokenizer
(the transcript's text). A batch is ONE ``/v1/completions`` request whose ``prompt`` is a list of
token-id lists (``return_token_ids``: the output ids; ``stop_token_ids``: the end ids;
``vllm_xargs``: the mask), streamed when one of its rows streams. The returned ids become codes
(``codes (t // N, t % N) = id - codebook_first_ids[t % N]``, an end id after the last frame
dropped) or text ids (``id - text_offset``), checked to lie where the masks put them.

Under greedy decoding the codes and texts are our decoder's, token for token (measured:
docs/serving.md). Sampling (temperature > 0) is vLLM's sampler, seeded with ``--seed``: not our
draws.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.generation.streaming import AudioStream
from torchtitan_speechlm.generation.vllm_export import check_servable, layout_note
from torchtitan_speechlm.generation.vllm_plugin import speechlm_vllm_mask as mask
from torchtitan_speechlm.serving.batcher import Runner
from torchtitan_speechlm.serving.rows import AsrRow, SpeechRow
from torchtitan_speechlm.serving.speech import prompt_codes

LOGITS_PROCESSOR = "speechlm_vllm_mask:FlattenAudioMask"
SERVED_NAME = "speechlm"  # --served-model-name of a vLLM this command starts


class VllmRowRefused(ValueError):
    """vLLM answered 400 for a batch (a prompt over its context, say): the request's fault,
    answered 400 (its row retried alone first, as every failed batch's)."""


class VllmFailed(RuntimeError):
    """vLLM did not answer, or answered an error that is not the request's: answered 500."""


def refusal(loaded: Loaded) -> str | None:
    """Why ``--engine vllm`` cannot serve this model (None: it can)."""
    try:
        check_servable(loaded.model.args)
    except ValueError as e:
        return (
            f"--engine vllm cannot serve {loaded.source}: {e}; serve it with --engine ours "
            "(the default)"
        )
    return None


# ---- the HTTP client ------------------------------------------------------------------------
class VllmClient:
    """vLLM's OpenAI-compatible server at ``url``: ``GET`` JSON, and ``complete`` (one
    ``/v1/completions`` request, streamed or not), on a fresh connection each call (batches
    run on several worker threads); ``api_key``: sent as ``Authorization: Bearer`` (vLLM's
    ``--api-key``)."""

    def __init__(self, url: str, timeout: float = 600.0, api_key: str | None = None):
        parts = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--vllm-url {url!r}: not an http(s) URL")
        self.url = f"{parts.scheme}://{parts.netloc}"
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base = parts.path.rstrip("/")
        if self.base.endswith("/v1"):  # OpenAI clients' base URLs end in /v1
            self.base = self.base[: -len("/v1")]
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model: str | None = None  # the served model's name (GET /v1/models)
        self.max_model_len: int | None = None

    def _connection(self, timeout: float | None = None) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout or self.timeout)

    def get(self, path: str, timeout: float | None = None) -> tuple[int, bytes]:
        conn = self._connection(timeout)
        try:
            conn.request("GET", self.base + path, headers=self.headers)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def connect(self) -> None:
        """Learn the served model's name and context (``GET /v1/models``); raises ValueError
        saying what failed."""
        try:
            status, body = self.get("/v1/models", timeout=30)
        except OSError as e:
            raise ValueError(f"--vllm-url {self.url}: no vLLM server answers there ({e})") from e
        if status == 401:
            given = "its key is not the one given" if self.headers else "it wants a key"
            raise ValueError(f"--vllm-url {self.url}: GET /v1/models answered 401: {given}; "
                             "give the key it was started with as --vllm-api-key")  # fmt: skip
        if status != 200:
            raise ValueError(f"--vllm-url {self.url}: GET /v1/models answered {status}: "
                             f"{body[:300]!r}")  # fmt: skip
        try:
            models = json.loads(body)["data"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--vllm-url {self.url}: GET /v1/models is not an OpenAI model "
                             f"list: {body[:300]!r}") from None  # fmt: skip
        if len(models) != 1:
            raise ValueError(f"--vllm-url {self.url}: it serves {len(models)} models, not one")
        self.model = models[0]["id"]
        self.max_model_len = models[0].get("max_model_len")

    def complete(
        self, body: dict, on_tokens: Callable[[int, list[int]], None] | None = None
    ) -> list[list[int]]:
        """The output token ids of each prompt of ``body``, in the prompts' order. With
        ``on_tokens`` the request streams and ``on_tokens(i, ids so far)`` is called as prompt
        i's ids arrive."""
        body = dict(body, model=self.model, return_token_ids=True, stream=on_tokens is not None)
        n = len(body["prompt"])
        conn = self._connection()
        try:
            conn.request("POST", self.base + "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json", **self.headers})  # fmt: skip
            r = conn.getresponse()
            if r.status != 200:
                raise _error(r.status, r.read())
            if on_tokens is None:
                return _ordered(json.loads(r.read())["choices"], n)
            ids: list[list[int]] = [[] for _ in range(n)]
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise VllmFailed(f"vLLM failed while streaming: {event['error']}")
                for choice in event.get("choices", []):
                    new = choice.get("token_ids") or []
                    if new:
                        ids[choice["index"]].extend(int(t) for t in new)
                        on_tokens(choice["index"], ids[choice["index"]])
            return ids
        except OSError as e:
            raise VllmFailed(f"vLLM at {self.url} did not answer: {e}") from e
        finally:
            conn.close()


def _error(status: int, body: bytes) -> Exception:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:500].decode(errors="replace")
    if status == 400:
        return VllmRowRefused(f"vLLM refused the request: {message}")
    return VllmFailed(f"vLLM answered {status}: {message}")


def _ordered(choices: list[dict], n: int) -> list[list[int]]:
    out: list[list[int] | None] = [None] * n
    for c in choices:
        if c.get("token_ids") is None:
            raise VllmFailed("vLLM gave no token_ids (return_token_ids: vLLM 0.10.2 or later)")
        out[c["index"]] = [int(t) for t in c["token_ids"]]
    if any(o is None for o in out):
        raise VllmFailed(f"vLLM answered {len(choices)} choices for {n} prompts")
    return out  # type: ignore[return-value]


# ---- requests and their answers (pure) ------------------------------------------------------
def prompt_ids(frames: np.ndarray, layout) -> list[int]:
    """A flatten prompt ([T, N] frames) as token ids: its stream 0 (every other stream holds
    its pad in a flatten prompt; anything else is refused)."""
    frames = np.asarray(frames)
    for k in range(1, layout.num_streams):
        if not (frames[:, k] == layout.stream_pad(k)).all():
            raise ValueError(f"a flatten prompt with tokens off stream 0 (stream {k})")
    return [int(x) for x in frames[:, 0]]


def _sampling(s, seed: int) -> dict:
    out: dict = {"temperature": float(s.temperature), "top_p": float(s.top_p), "seed": int(seed)}
    if s.top_k:
        out["top_k"] = int(s.top_k)
    return out


def _max_tokens(wanted: int, max_model_len: int | None) -> int:
    """vLLM refuses max_tokens over its max_model_len (and stops each row at its context)."""
    return min(wanted, max_model_len) if max_model_len else wanted


def tts_body(prompts: list[list[int]], cfg: DecodeConfig, note: dict,
             max_model_len: int | None = None) -> dict:  # fmt: skip
    """A batch of TTS prompts as one completions request: up to ``max_frames`` frames of N
    tokens, the end allowed from frame ``min_frames`` (the mask), the end ids stopping it."""
    return {
        "prompt": prompts,
        "max_tokens": _max_tokens(cfg.max_frames * note["num_streams"], max_model_len),
        "stop_token_ids": list(note["end_ids"]),
        "vllm_xargs": {mask.AUDIO: int(cfg.min_frames)},
        **_sampling(cfg.audio, cfg.seed),
    }


def asr_body(prompts: list[list[int]], cfg: DecodeConfig, note: dict,
             max_model_len: int | None = None) -> dict:  # fmt: skip
    """A batch of ASR prompts as one completions request: up to ``max_text_tokens`` text ids
    (the mask: text ids and the end ids), the end ids stopping it."""
    return {
        "prompt": prompts,
        "max_tokens": _max_tokens(cfg.max_text_tokens, max_model_len),
        "stop_token_ids": list(note["end_ids"]),
        "vllm_xargs": {mask.TEXT: 1},
        **_sampling(cfg.text, cfg.seed),
    }


def audio_codes(ids: list[int], note: dict) -> tuple[np.ndarray, bool]:
    """A TTS row's output ids as codes [F, N] and whether the model chose its end. Raises
    VllmFailed where an id is not the one the mask allows at its step (the mask not loaded)."""
    n, size, firsts = note["num_streams"], note["codebook_size"], note["codebook_first_ids"]
    ended = bool(ids) and ids[-1] in note["end_ids"]
    body = ids[:-1] if ended else ids
    whole = len(body) // n * n  # a row vLLM stopped at its context mid-frame: whole frames
    codes = np.asarray(body[:whole], dtype=np.int64).reshape(-1, n) - np.asarray(firsts)
    bad = np.argwhere((codes < 0) | (codes >= size))
    if len(bad) or (ended and len(body) % n):
        at = int(bad[0][0] * n + bad[0][1]) if len(bad) else len(body)
        raise VllmFailed(
            f"vLLM gave id {ids[at]} at audio step {at}, which the FlattenAudioMask forbids: is "
            f"the server started with --logits-processors {LOGITS_PROCESSOR}?"
        )
    return codes, ended


def text_ids(ids: list[int], note: dict) -> list[int]:
    """An ASR row's output ids as the tokenizer's ids (an end id after them dropped)."""
    lo, hi = note["text_ids"]
    body = ids[:-1] if ids and ids[-1] in note["end_ids"] else ids
    if any(not lo <= i < hi for i in body):
        raise VllmFailed(
            f"vLLM gave ids outside the text vocabulary: is the server started with "
            f"--logits-processors {LOGITS_PROCESSOR}?"
        )
    return [i - lo for i in body]


def check_probe(client: VllmClient, note: dict, prompt: list[int]) -> None:
    """Raise ValueError unless the server runs FlattenAudioMask over this model's layout: a
    ``speechlm_probe`` request must come back as ``probe_ids`` of our own layout note."""
    want = mask.probe_ids(note)
    body = {"prompt": [prompt], "max_tokens": len(want), "temperature": 0.0,
            "stop_token_ids": list(note["end_ids"]), "vllm_xargs": {mask.PROBE: 1}}  # fmt: skip
    try:
        got = client.complete(body)[0]
    except (VllmFailed, VllmRowRefused) as e:
        raise ValueError(f"--engine vllm: the probe request to {client.url} failed: {e}") from e
    if got != want:
        raise ValueError(
            f"--engine vllm: the vLLM server at {client.url} does not apply this model's masks "
            f"(probe ids {got}, expected {want}): serve this model's vllm_export folder with "
            f"--skip-tokenizer-init --logits-processors {LOGITS_PROCESSOR} and that folder on "
            "vLLM's PYTHONPATH (it holds speechlm_vllm_mask.py; docs/serving.md)"
        )


# ---- the runners -----------------------------------------------------------------------------
@dataclass
class VllmRunners:
    """The batcher's runners over ``client``; ``lock`` guards what stays here and is not
    thread-safe (the tokenizer, the codec), as batches run on several worker threads."""

    loaded: Loaded
    cfg: DecodeConfig
    client: VllmClient

    def __post_init__(self) -> None:
        self.note = layout_note(self.loaded.model.args)
        self.lock = threading.Lock()

    def speak(self, rows: list[SpeechRow], emit: Callable[[int, np.ndarray], None]) -> list[int]:
        """serving/speech.py ``speak`` with the codes from vLLM."""
        lay, loaded = self.loaded.layout, self.loaded
        with self.lock:
            speakers = [prompt_codes(loaded, r) for r in rows]
            frames = tasks.fit_context(loaded, tasks.tts_prompts(
                loaded, [r.text for r in rows], speakers))  # fmt: skip
            streams = {i: AudioStream(loaded.codec, lambda block, i=i: emit(i, block))
                       for i, r in enumerate(rows) if r.stream}  # fmt: skip
        body = tts_body([prompt_ids(f, lay) for f in frames], self.cfg, self.note,
                        self.client.max_model_len)  # fmt: skip
        n = self.note["num_streams"]

        def on_tokens(i: int, ids: list[int]) -> None:  # the row's complete frames so far
            if i in streams and len(ids) // n > streams[i].sent:  # a new whole frame
                codes, _ = audio_codes(ids, self.note)
                with self.lock:
                    streams[i].frames(codes)

        ids = self.client.complete(body, on_tokens if streams else None)
        codes = [audio_codes(t, self.note)[0] for t in ids]
        samples = [0] * len(rows)
        with self.lock:
            for i, stream in streams.items():
                samples[i] = stream.finish(codes[i])
            whole = [i for i in range(len(rows)) if i not in streams]
            waves = tasks.decode_audio(loaded, [codes[i] for i in whole])
        for i, wave in zip(whole, waves, strict=True):
            wave = np.asarray(wave, dtype=np.float32).reshape(-1)
            samples[i] = len(wave)
            emit(i, wave)
        return samples

    def transcribe(self, rows: list[AsrRow]) -> list[str]:
        """serving/speech.py ``transcribe`` with the text ids from vLLM: one request per
        temperature asked."""
        loaded, cfg = self.loaded, self.cfg
        with self.lock:
            codes = loaded.codec.encode([r.wave for r in rows])
            frames = tasks.fit_context(loaded, tasks.asr_prompts(loaded, codes))
        prompts = [prompt_ids(f, loaded.layout) for f in frames]
        out = [""] * len(rows)
        temps = [cfg.text.temperature if r.temperature is None else r.temperature for r in rows]
        for t in dict.fromkeys(temps):
            idx = [i for i, ti in enumerate(temps) if ti == t]
            run = replace(cfg, text=replace(cfg.text, temperature=t))
            ids = self.client.complete(asr_body([prompts[i] for i in idx], run, self.note,
                                                self.client.max_model_len))  # fmt: skip
            with self.lock:
                for i, row in zip(idx, ids, strict=True):
                    out[i] = loaded.tokenizer.decode(text_ids(row, self.note))
        return out

    def runners(self) -> dict[str, Runner]:
        return {
            "tts": lambda rows, emit: self.speak(list(rows), emit),
            "asr": lambda rows, emit: self.transcribe(list(rows)),
        }


def connect(loaded: Loaded, cfg: DecodeConfig, url: str, timeout: float,
            api_key: str | None = None) -> VllmRunners:  # fmt: skip
    """The runners over the vLLM server at ``url`` (its key: ``api_key``), once it is known
    to serve this model's layout with our masks (``check_probe``); ValueError saying what is
    wrong otherwise."""
    why = refusal(loaded)
    if why:
        raise ValueError(why)
    client = VllmClient(url, timeout, api_key)
    client.connect()
    engine = VllmRunners(loaded, cfg, client)
    bos = [loaded.layout.special("<|bos|>")]
    check_probe(client, engine.note, bos)
    return engine
