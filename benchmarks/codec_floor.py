"""How intelligible is the k-means codec's own resynthesis of many voices? The WER floor behind
the speaker-prompted TTS benchmark (docs/quality.md, *Speaker-prompted TTS: the learning
benchmark*).

A TTS model's WER cannot beat the codec it speaks through: a model that reproduced its target
codes exactly would be heard as the codec's resynthesis. ``bench_speaker_prompt.py`` reports
that floor for its one codec; this measures it for several codec fits and for the log-mel
representation itself, on the same corpora (``demo/voices.build_voice_corpus``, the benchmark's
settings, so its corpus folders are reused):

- ``recordings``: the judge on espeak-ng's own audio (the judge alone);
- ``fits``: a codec fitted (``fit_kmeans_codec``, on a seeded draw of the training utterances up
  to ``SECONDS`` of audio) with ``CODEBOOKS`` x ``SIZE`` centroids at ``FPS`` frames/s, then each
  held-out utterance encoded and decoded;
- ``unquantised``: the same log-mel at ``--oracle-rates`` frames/s inverted by the codec's
  Griffin-Lim without any quantisation (what no number of centroids can improve on);
- for the multi-speaker corpus (seen speakers' held-out sentences) and the one-voice corpus of
  the unprompted baseline (the same sentences in the demo's voice), and per speaker.

The judge is the benchmark's: PocketSphinx restricted to the demo grammar.

    python benchmarks/codec_floor.py                       # ~10 minutes on 2 CPU cores
    python benchmarks/codec_floor.py --fits 60:2:16:25 --oracle-rates 25 \
        --train-per-speaker 2 --heldout-per-speaker 2 --work /tmp/cf --out /tmp/cf.json  # smoke

Writes benchmarks/results/codec_floor.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import soundfile as sf
import torch

from torchtitan_speechlm.codecs import load_codec
from torchtitan_speechlm.codecs.kmeans import KMeansCodec, fit_kmeans_codec
from torchtitan_speechlm.demo import grammar
from torchtitan_speechlm.demo.voices import build_voice_corpus, voice
from torchtitan_speechlm.judges import build_judge, error_rates

HERE = os.path.dirname(os.path.abspath(__file__))
BASELINE_VOICE = "us"  # bench_speaker_prompt.py's baseline: the demo's voice


class UnquantisedKMeans(KMeansCodec):
    """The codec's decoder fed log-mel frames ``[F, n_mels]`` instead of codes: its Griffin-Lim
    on the exact features (an oracle for any codebook)."""

    def __init__(self, codec: KMeansCodec):
        self.__dict__.update(codec.__dict__)
        self.num_streams = self.cfg.n_mels  # a "frame" is now n_mels values

    def log_mel(self, codes: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(codes), dtype=torch.float32, device=self.device)

    def features_of(self, wavs: list[np.ndarray]) -> list[np.ndarray]:
        with torch.inference_mode():
            return [self.features(w).cpu().numpy() for w in wavs]


def read(manifest: str) -> tuple[list[dict], list[np.ndarray]]:
    rows = [json.loads(line) for line in open(manifest)]
    base = os.path.dirname(manifest)
    return rows, [sf.read(os.path.join(base, r["audio"]), dtype="float32")[0] for r in rows]


def wer(asr, rows: list[dict], wavs: list[np.ndarray], rate: int) -> dict:
    """Corpus WER, and per speaker."""
    heard = [asr.transcribe(w, rate) for w in wavs]
    out = {"wer": error_rates([r["text"] for r in rows], heard)["wer"], "per_speaker": {}}
    for s in sorted({r["speaker"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["speaker"] == s]
        out["per_speaker"][s] = error_rates(
            [rows[i]["text"] for i in idx], [heard[i] for i in idx]
        )["wer"]
    return out


def draw(wavs: list[np.ndarray], seconds: float, rate: int, seed: int = 0) -> list[np.ndarray]:
    picked, total = [], 0.0
    for i in np.random.default_rng(seed).permutation(len(wavs)):
        if total >= seconds:
            break
        picked.append(wavs[i])
        total += len(wavs[i]) / rate
    return picked


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=os.path.join(HERE, "work", "speaker_prompt"))
    p.add_argument("--train-per-speaker", type=int, default=600)
    p.add_argument("--heldout-per-speaker", type=int, default=10)
    p.add_argument("--fits", default="600:4:256:25,2400:4:256:25,2400:4:512:25,2400:6:256:25,"
                   "2400:4:256:50", help="SECONDS:CODEBOOKS:SIZE:FPS,...")  # fmt: skip
    p.add_argument("--oracle-rates", default="25,50", help="frames/s of the unquantised log-mel")
    p.add_argument("--out", default=os.path.join(HERE, "results", "codec_floor.json"))
    a = p.parse_args()
    t0 = time.perf_counter()
    multi = build_voice_corpus(os.path.join(a.work, "corpus_voices"), a.train_per_speaker,
                               a.heldout_per_speaker)  # fmt: skip
    single = build_voice_corpus(
        os.path.join(a.work, "corpus_one_voice"), len(multi.seen) * a.train_per_speaker,
        a.heldout_per_speaker, voices=(voice(BASELINE_VOICE),), held_out=(),
    )  # fmt: skip
    rate = 16000
    fit_on = {"voices": read(multi.train)[1], "one_voice": read(single.train)[1]}
    corpora = {  # name: (rows, wavs, the training audio its codec is fitted on)
        "voices": (*read(multi.heldout), "voices"),
        "held_out_speakers": (*read(multi.heldout_speakers), "voices"),
        "one_voice": (*read(single.heldout), "one_voice"),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".jsgf", delete=False) as f:
        f.write(grammar.jsgf())
    asr = build_judge("pocketsphinx", grammar=f.name)
    result: dict = {"recordings": {k: wer(asr, r, w, rate) for k, (r, w, _) in corpora.items()}}
    result["fits"], result["unquantised"] = [], []
    scratch = tempfile.mkdtemp(prefix="codec_floor-")
    for spec in a.fits.split(","):
        seconds, books, size, fps = (float(x) for x in spec.split(":"))
        row = {"seconds": seconds, "codebooks": int(books), "size": int(size), "fps": fps}
        for source, train in fit_on.items():
            folder = os.path.join(scratch, f"{source}-{spec.replace(':', '_')}")
            fit_kmeans_codec(draw(train, seconds, rate), folder, num_codebooks=int(books),
                             codebook_size=int(size), frame_rate=fps,
                             max_frames=int(seconds * fps))  # fmt: skip
            codec = load_codec(folder)
            for name, (rows, wavs, fitted) in corpora.items():
                if fitted == source:
                    row[name] = wer(asr, rows, codec.decode_batch(codec.encode(wavs)), rate)
        print(f"[codec_floor] {spec}: " + ", ".join(f"{k} {row[k]['wer']:.3f}" for k in corpora),
              flush=True)  # fmt: skip
        result["fits"].append(row)
    for fps in (float(x) for x in a.oracle_rates.split(",")):
        folder = os.path.join(scratch, f"oracle-{fps:g}")  # only its STFT geometry is used
        fit_kmeans_codec(fit_on["voices"][:8], folder, codebook_size=8, frame_rate=fps, iters=1)
        oracle = UnquantisedKMeans(load_codec(folder))
        row = {"fps": fps}
        for name, (rows, wavs, _) in corpora.items():
            row[name] = wer(asr, rows, oracle.decode_batch(oracle.features_of(wavs)), rate)
        print(f"[codec_floor] unquantised {fps:g} fps: "
              + ", ".join(f"{k} {row[k]['wer']:.3f}" for k in corpora), flush=True)  # fmt: skip
        result["unquantised"].append(row)
    out = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "python benchmarks/codec_floor.py " + " ".join(sys.argv[1:]),
        "judge": "pocketsphinx, demo grammar",
        "items": {k: len(v[0]) for k, v in corpora.items()},
        **result,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"[codec_floor] wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
