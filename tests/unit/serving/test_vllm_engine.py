"""`torchtitan serve --engine vllm` without vLLM (serving/vllm_engine.py, vllm_process.py, the
logits processor vllm_plugin/speechlm_vllm_mask.py; the real vLLM run is
tests/integration/test_serve_vllm.py).

A tiny flatten SpeechLM (random weights, sharpened as test_vllm_export.py does, over the tests'
tokenizer and tiny codec) is exported as a causal LM and served by a stand-in for vLLM's
completions route: transformers' greedy ``generate`` on the export under the masks the layout
note states (``vllm_export.audio_allowed``; text: the text range and the end ids), not the
plugin's code. Through it, the vLLM runners' speech (whole and streamed) and transcripts equal
our own engine's runners' (serving/speech.py) exactly. Also: the ids -> codes / text rules
against codes written here, the requests' fields, the plugin's masks against ``audio_allowed``,
the start-up probe (a server without the plugin is refused), what the flags refuse, and the
vLLM process's start, failure and stop with a stand-in interpreter."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from tests.helpers import build_speechlm, tiny_model_assets
from torchtitan_speechlm.commands.serve_args import build_parser, check_engine_flags
from torchtitan_speechlm.generation import tasks
from torchtitan_speechlm.generation.decode import DecodeConfig
from torchtitan_speechlm.generation.loading import Loaded
from torchtitan_speechlm.generation.sampling import Sampling
from torchtitan_speechlm.generation.vllm_export import (
    NOTE_FILE,
    audio_allowed,
    export_flatten_lm,
)
from torchtitan_speechlm.generation.vllm_plugin import speechlm_vllm_mask as plugin
from torchtitan_speechlm.serving import vllm_engine as ve
from torchtitan_speechlm.serving.rows import AsrRow, SpeechRow
from torchtitan_speechlm.serving.speech import runners as our_runners
from torchtitan_speechlm.serving.vllm_process import VllmProcess

N, C = 4, 64  # the tiny codec's codebooks


def flatten_model(assets: dict, root, name: str, end_scale: float) -> dict:
    torch.manual_seed(0)
    model = build_speechlm(assets["backbone"], num_streams=N, codebook_size=C, pattern="flatten")
    lay = model.args.layout
    with torch.no_grad():  # sharper logits: the greedy picks are not near-ties
        model.tok_embeddings.weight.normal_(0, 1.0)
        model.head.output.weight.normal_(0, 1.0)
        for end in ("<|eos|>", "<|eot|>"):
            model.head.output.weight[lay.special(end)] *= end_scale
    model.eval()
    lm = str(root / name)
    export_flatten_lm(model, lm)
    return {
        "lm": lm,
        "loaded": Loaded(model, {}, assets["tokenizer"], assets["codec"], name),
        "note": json.loads(open(os.path.join(lm, NOTE_FILE)).read()),
        "hf": AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).eval(),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two random flatten models: ``plain`` speaks to the frame limit and transcribes to the
    token limit; in ``ends`` the end ids' head rows are 5x larger (measured: 2 of 4 TTS rows end
    at 3 frames, and every transcript ends at once)."""
    root = tmp_path_factory.mktemp("vllm_engine")
    assets = tiny_model_assets(root / "assets")
    delay = build_speechlm(assets["backbone"], num_streams=N, codebook_size=C, pattern="delay")
    return {
        "plain": flatten_model(assets, root, "plain", 1.0),
        "ends": flatten_model(assets, root, "ends", 5.0),
        "delay": Loaded(delay, {}, assets["tokenizer"], assets["codec"], "tiny-delay"),
    }


# ---- a stand-in for vLLM's completions route ---------------------------------------------
class NoteMask(LogitsProcessor):
    """The note's rules, written from ``audio_allowed`` (not the plugin)."""

    def __init__(self, note: dict, start: int, xargs: dict):
        self.note, self.start, self.xargs = note, start, xargs

    def __call__(self, input_ids, scores):
        step, keep = input_ids.shape[1] - self.start, torch.zeros_like(scores, dtype=torch.bool)
        if "speechlm_audio_min_frames" in self.xargs:
            ranges = audio_allowed(self.note, step, self.xargs["speechlm_audio_min_frames"])
        elif "speechlm_text" in self.xargs:
            ranges = [tuple(self.note["text_ids"])] + [(e, e + 1) for e in self.note["end_ids"]]
        else:
            return scores
        for a, b in ranges:
            keep[:, a:b] = True
        return scores.masked_fill(~keep, float("-inf"))


class FakeVllm:
    """``GET /v1/models``, ``GET /health`` and ``POST /v1/completions`` (token-id prompts,
    ``return_token_ids``, ``stream``) over transformers' greedy decoding of the export.
    ``probe``: answer ``speechlm_probe`` as the plugin does (False: as a vLLM without it, which
    ignores the unknown xarg). ``bodies``: the requests received."""

    def __init__(self, hf, note: dict, probe: bool = True):
        self.hf, self.note, self.probe, self.bodies = hf, note, probe, []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, payload: bytes, kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                if self.path == "/v1/models":
                    data = {"data": [{"id": "fake", "max_model_len": 4096}]}
                    self._send(200, json.dumps(data).encode())
                else:
                    self._send(200, b"")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                outs = [fake.generate(p, body) for p in body["prompt"]]
                if not body.get("stream"):
                    choices = [{"index": i, "text": "", "token_ids": o} for i, o in enumerate(outs)]
                    self._send(200, json.dumps({"choices": choices}).encode())
                    return
                events = [{"choices": [{"index": i, "token_ids": [t]}]}
                          for i, o in enumerate(outs) for t in o]  # fmt: skip
                text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                self._send(200, text.encode(), "text/event-stream")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def generate(self, prompt: list[int], body: dict) -> list[int]:
        assert body["temperature"] == 0.0 and body["return_token_ids"] is True
        xargs = body.get("vllm_xargs") or {}
        if xargs.get("speechlm_probe") and self.probe:
            return plugin.probe_ids(self.note)
        ids = torch.tensor([prompt])
        out = self.hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=body["max_tokens"],
            do_sample=False, eos_token_id=body["stop_token_ids"], pad_token_id=0,
            logits_processor=LogitsProcessorList([NoteMask(self.note, len(prompt), xargs)]),
        )  # fmt: skip
        return out[0, len(prompt) :].tolist()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def run_rows(runner, rows) -> tuple[list, dict]:
    pieces: dict[int, list] = {}
    results = runner(rows, lambda i, piece: pieces.setdefault(i, []).append(piece))
    return results, {i: np.concatenate(p) for i, p in pieces.items()}


# ---- the runners against our own engine ---------------------------------------------------
@pytest.mark.parametrize("which", ["plain", "ends"])
def test_speech_and_transcripts_equal_our_engine(tiny, which):
    m = tiny[which]
    loaded, note = m["loaded"], m["note"]
    fake = FakeVllm(m["hf"], note)
    cfg = DecodeConfig(max_frames=6, min_frames=2, max_text_tokens=8)
    try:
        theirs = ve.connect(loaded, cfg, fake.url + "/v1", timeout=60).runners()
        ours = our_runners(loaded, cfg)
        rows = [
            SpeechRow("She sells fresh bread."),
            SpeechRow("Hi.", stream=True),
            SpeechRow("The train leaves at noon."),
            SpeechRow("Please close the window."),
        ]
        got, got_audio = run_rows(theirs["tts"], rows)
        want, want_audio = run_rows(ours["tts"], rows)
        tts_body = fake.bodies[-1]
        rng = np.random.default_rng(0)
        asr = [AsrRow(rng.uniform(-0.3, 0.3, n).astype(np.float32)) for n in (960, 1600, 2560)]
        texts = theirs["asr"](asr, None)
        asr_body = fake.bodies[-1]
        assert texts == ours["asr"](asr, None)
    finally:
        fake.close()
    spf = loaded.codec.samples_per_frame
    assert (
        got == want == {"plain": [6 * spf] * 4, "ends": [6 * spf, 3 * spf, 3 * spf, 6 * spf]}[which]
    )  # the frame limit, or the model's own end (its end id dropped)
    for i in range(4):  # whole rows: the same codes through one decode_audio; streamed as ours
        np.testing.assert_array_equal(got_audio[i], want_audio[i])
    # the request: one completions call for the batch, streamed (a row streams), its prompts
    # the template's stream 0, our decoder's limits and the mask's min frames
    prompts = tasks.tts_prompts(loaded, [r.text for r in rows])
    assert tts_body["prompt"] == [p[:, 0].tolist() for p in prompts] and tts_body["stream"]
    assert tts_body["max_tokens"] == 6 * N and tts_body["stop_token_ids"] == note["end_ids"]
    assert tts_body["vllm_xargs"] == {"speechlm_audio_min_frames": 2}
    assert tts_body["model"] == "fake"
    # plain: 8 text ids each (the limit); ends: the end id first, an empty transcript
    assert [bool(t) for t in texts] == [which == "plain"] * 3
    assert asr_body["vllm_xargs"] == {"speechlm_text": 1}
    assert asr_body["max_tokens"] == 8 and asr_body["stream"] is False


def test_a_server_without_the_plugin_is_refused_at_start(tiny):
    m = tiny["plain"]
    server = FakeVllm(m["hf"], m["note"], probe=False)
    try:
        with pytest.raises(ValueError, match="--logits-processors speechlm_vllm_mask:Flatten"):
            ve.connect(m["loaded"], DecodeConfig(), server.url, timeout=60)
    finally:
        server.close()
    with pytest.raises(ValueError, match="no vLLM server answers there"):
        ve.connect(m["loaded"], DecodeConfig(), "http://127.0.0.1:9", timeout=5)


def test_delay_models_and_audio_encoders_are_refused(tiny):
    why = ve.refusal(tiny["delay"])
    assert "pattern 'delay'" in why and "--engine ours" in why
    assert ve.refusal(tiny["plain"]["loaded"]) is None


# ---- ids -> codes / text, written independently ------------------------------------------
def test_ids_become_codes_and_text(tiny):
    lay, note = tiny["plain"]["loaded"].layout, tiny["plain"]["note"]
    codes = np.random.default_rng(0).integers(0, C, (5, N))
    ids = [lay.code(k, int(codes[f, k])) for f in range(5) for k in range(N)]
    got, ended = ve.audio_codes(ids + [lay.special("<|eot|>")], note)
    np.testing.assert_array_equal(got, codes)
    assert ended and got.dtype == np.int64
    got, ended = ve.audio_codes(ids + ids[:2], note)  # stopped mid-frame (its context): whole
    np.testing.assert_array_equal(got, codes)
    assert not ended
    assert ve.audio_codes([], note)[0].shape == (0, N)
    with pytest.raises(ve.VllmFailed, match="FlattenAudioMask forbids"):
        ve.audio_codes([ids[1]] + ids[1:4], note)  # codebook 1's code at a codebook 0 step
    with pytest.raises(ve.VllmFailed, match="forbids"):
        ve.audio_codes(ids[:2] + [lay.special("<|eos|>")], note)  # an end inside a frame

    text = [5, 0, 17]
    ids = [lay.text_offset + i for i in text]
    assert ve.text_ids(ids + [lay.special("<|eos|>")], note) == text == ve.text_ids(ids, note)
    with pytest.raises(ve.VllmFailed, match="outside the text vocabulary"):
        ve.text_ids([lay.code(0, 3)], note)


def test_prompts_are_stream_0_of_a_flatten_prompt(tiny):
    loaded = tiny["plain"]["loaded"]
    lay = loaded.layout
    frames = tasks.tts_prompts(loaded, ["Hi."])[0]
    assert ve.prompt_ids(frames, lay) == frames[:, 0].tolist()
    assert ve.prompt_ids(frames, lay)[-1] == lay.special("<|audio|>")
    bad = frames.copy()
    bad[1, 2] = lay.code(2, 0)
    with pytest.raises(ValueError, match="off stream 0"):
        ve.prompt_ids(bad, lay)


def test_request_fields(tiny):
    note = tiny["plain"]["note"]
    cfg = DecodeConfig(audio=Sampling(0.8, 50, 0.9), max_frames=500, min_frames=3,
                       max_text_tokens=20, seed=7)  # fmt: skip
    body = ve.tts_body([[1, 2]], cfg, note, max_model_len=1024)
    assert body["max_tokens"] == 1024  # 500 x 4 over vLLM's context: refused there, capped here
    assert (body["temperature"], body["top_k"], body["top_p"], body["seed"]) == (0.8, 50, 0.9, 7)
    body = ve.asr_body([[1, 2], [3]], cfg, note)
    assert body["max_tokens"] == 20 and body["prompt"] == [[1, 2], [3]]
    assert body["temperature"] == 0.0 and "top_k" not in body  # 0: no top-k, vLLM's default


# ---- the plugin's masks against the note's rules ------------------------------------------
def test_the_plugin_masks_are_the_note_s_rules(tiny):
    note = tiny["plain"]["note"]
    vocab = note["vocab_size"]
    proc = plugin.FlattenAudioMask.from_note(note, vocab)

    def ranges_mask(ranges):
        m = torch.zeros(vocab, dtype=torch.bool)
        for a, b in ranges:
            m[a:b] = True
        return m

    for min_frames in (0, 1, 3):
        for step in range(4 * N):
            want = ranges_mask(audio_allowed(note, step, min_frames))
            assert torch.equal(proc.allowed(plugin.AUDIO, min_frames, step), want), (
                step,
                min_frames,
            )
    text = ranges_mask([tuple(note["text_ids"])] + [(e, e + 1) for e in note["end_ids"]])
    assert torch.equal(proc.allowed(plugin.TEXT, 1, 5), text)
    probe = plugin.probe_ids(note)
    assert len(probe) == N + 1 and probe[-1] in note["end_ids"]
    assert all(note["codebook_first_ids"][k] <= probe[k] < note["codebook_first_ids"][k] + C
               for k in range(N))  # fmt: skip
    # apply(): only the rows that asked, each at its own step
    proc.rows = {0: (plugin.AUDIO, 1, [0] * N), 2: (plugin.TEXT, 1, [])}
    logits = torch.zeros(3, vocab)
    out = proc.apply(logits.clone())
    assert torch.equal(out[0] > -1, ranges_mask(audio_allowed(note, N, 1)))
    assert torch.equal(out[1], logits[1]) and torch.equal(out[2] > -1, text)
    with pytest.raises(ValueError, match="one of"):
        plugin.request_mode({plugin.AUDIO: 1, plugin.TEXT: 1})
    with pytest.raises(ValueError, match="an integer"):
        plugin.request_mode({plugin.AUDIO: 1.5})
    assert plugin.request_mode({"other": 1}) is None


def test_the_plugin_imports_nothing_of_this_package():
    source = open(plugin.__file__).read()
    assert "torchtitan" not in source.replace("torchtitan-speechlm", "")
    assert plugin.NOTE_FILE == NOTE_FILE


def test_the_export_carries_the_plugin(tiny):
    """vllm_export writes the module beside the weights: `PYTHONPATH=LM vllm serve LM` finds it."""
    with open(os.path.join(tiny["plain"]["lm"], "speechlm_vllm_mask.py")) as f:
        assert f.read() == open(plugin.__file__).read()


# ---- the flags -----------------------------------------------------------------------------
def flags(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["--model", "m", *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--vllm-url", "http://x"], "--vllm-url: only with --engine vllm"),
        (["--vllm-kv-cache-mb", "64"], "--vllm-kv-cache-mb: only with --engine vllm"),
        (["--engine", "vllm"], "give --vllm-url URL"),
        (["--engine", "vllm", "--vllm-url", "u", "--vllm-python", "p"], "one of them"),
        (["--engine", "vllm", "--vllm-url", "u", "--vllm-arg=--enforce-eager"],
         "--vllm-arg: only with --vllm-python"),
        (["--engine", "vllm", "--vllm-url", "u", "--cfg-scale", "2"],
         "--cfg-scale is not taken with --engine vllm"),
        (["--engine", "vllm", "--vllm-url", "u", "--no-cache"], "--no-cache is not taken"),
        (["--engine", "vllm", "--vllm-url", "u", "--compile", "on"], "--compile is not taken"),
        (["--engine", "vllm", "--vllm-url", "u", "--replicas", "2"], "--replicas is not taken"),
        (["--engine", "vllm", "--vllm-url", "u", "--vllm-batches-in-flight", "0"], "at least 1"),
    ],
)  # fmt: skip
def test_flags_that_make_no_sense_are_refused(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_engine_flags(flags(*argv))


def test_flags_that_make_sense_pass():
    check_engine_flags(flags())
    check_engine_flags(flags("--engine", "vllm", "--vllm-url", "http://h:1/v1", "--seed", "3"))
    check_engine_flags(flags("--engine", "vllm", "--vllm-python", "p", "--vllm-arg=-x",
                             "--vllm-kv-cache-mb", "64", "--temperature", "0.7"))  # fmt: skip


# ---- the vLLM process, with a stand-in interpreter -----------------------------------------
STAND_IN = """#!{python}
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if sys.argv[1] == "-c":
    print("0.0-stand-in")
    sys.exit(0)
argv = sys.argv[1:]
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "seen.json"), "w") as f:
    json.dump({{"argv": argv, "pythonpath": os.environ.get("PYTHONPATH", ""),
               "cwd": os.getcwd()}}, f)
print("{say}", flush=True)
if "{mode}" == "fail":
    sys.exit(3)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if "{mode}" == "ok" else 503)
        self.end_headers()
HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), H).serve_forever()
"""


def stand_in(folder, mode: str, say: str) -> str:
    path = os.path.join(folder, f"python_{mode}")
    with open(path, "w") as f:
        f.write(STAND_IN.format(python=sys.executable, mode=mode, say=say))
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def test_the_vllm_process_starts_answers_and_stops(tiny, tmp_path):
    said: list[str] = []
    proc = VllmProcess(stand_in(tmp_path, "ok", "hello"), None, kv_cache_mb=64,
                       extra=["--enforce-eager"], timeout_s=60, say=said.append)  # fmt: skip
    url = proc.start(tiny["plain"]["loaded"])
    seen = json.load(open(tmp_path / "seen.json"))
    argv = seen["argv"]
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == os.path.join(proc.work, "lm")
    assert os.path.exists(os.path.join(proc.work, "lm", NOTE_FILE))
    assert "--skip-tokenizer-init" in argv and argv[-1] == "--enforce-eager"
    assert argv[argv.index("--logits-processors") + 1] == ve.LOGITS_PROCESSOR
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
    assert seen["pythonpath"].split(os.pathsep)[0] == os.path.join(proc.work, "lm")
    assert url == f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    assert any(s.startswith("vllm: ready") for s in said)
    pid = proc.proc.pid
    proc.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # its whole group is gone
    assert not os.path.exists(proc.work)  # a folder it made itself


def test_a_vllm_that_dies_or_never_answers_names_its_log(tiny, tmp_path):
    proc = VllmProcess(stand_in(tmp_path, "fail", "CUDA out of memory"), str(tmp_path / "w"),
                       timeout_s=60, say=lambda s: None)  # fmt: skip
    with pytest.raises(ValueError, match=r"exited with status 3.*vllm\.log.*CUDA out of memory"):
        proc.start(tiny["plain"]["loaded"])
    assert os.path.exists(tmp_path / "w" / "vllm.log")
    proc = VllmProcess(stand_in(tmp_path, "busy", "loading"), str(tmp_path / "w2"),
                       timeout_s=1.5, say=lambda s: None)  # fmt: skip
    with pytest.raises(ValueError, match=r"--vllm-start-timeout 1\.5 s; its log: .*vllm\.log"):
        proc.start(tiny["plain"]["loaded"])
    assert "loading" in open(proc.log).read()  # kept: the error names it
    unstarted = VllmProcess(sys.executable, None)
    with pytest.raises(ValueError, match="has no vllm installed"):
        unstarted.check_python()
    assert unstarted.work is None  # no temporary folder before a start
