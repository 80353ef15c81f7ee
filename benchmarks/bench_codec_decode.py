"""k-means codec decode: quality against Griffin-Lim iterations, and speed against the old decode.

The codec is fitted like the demo's (``demo/speaking.py``): the grammar's sentences spoken by
espeak-ng (voice en-us, 175 words/min), fitted by ``torchtitan prepare``'s own
``fit_or_reuse_codec`` with prepare's codebook defaults (4 x 256) on the demo's 600 s of audio
at its 25 frames/s. Held-out sentences (never fitted on) are encoded, then decoded with classic
(momentum 0) and fast (momentum 0.99) Griffin-Lim at each ``--iters`` count, with the old decode
(commit 896967e: torch.istft/stft fast Griffin-Lim, 48 iterations; kept here as
``legacy_decode``) and with the stream decoder. Every decode is judged like ``torchtitan eval``
judges the demo: WER of the pocketsphinx recogniser restricted to the grammar (per utterance),
DNSMOS (on consecutive utterances joined into >= 9.01 s groups: one DNSMOS window each; a
shorter clip is repeated to 16 s and costs 7), plus Griffin-Lim's spectral convergence and the
log-mel distance to the recording.

The chosen count is the fewest fast-GL iterations that the judges cannot tell from 48-iteration
classic GL nor from the old decode: paired over the held-out set (bootstrap, 2000 resamples,
seeded), the 95% interval of the WER difference reaches 0 (not measurably worse) and for each of
DNSMOS overall/signal/background the interval reaches 0 or the mean difference is under 0.05.

Speed: the real-time factor (decode seconds / audio seconds) of the first 8 held-out clips at
batch 1 (one decode per clip) and batch 8 (one ``decode_batch``), old decode vs new at 48
iterations and at the chosen count, interleaved (A/B/C...) after a warm-up, medians of
``--repeats``, with ``--threads`` torch threads (1: on 2 shared, busy cores a second thread
makes timings erratic); the stream decoder at the chosen count (``--stream-chunk`` and 4
frames per push). Writes ``benchmarks/results/codec_decode_cpu.json`` (``--out``);
``--speed-only`` times again and keeps that file's quality table.

    python benchmarks/bench_codec_decode.py [--held-out 200] [--iters 4,8,16,32,48] [--repeats 5]

Smallest setting (a smoke test of the script): ``--train-sentences 40 --kmeans-seconds 30
--codebook-size 16 --held-out 2 --iters 2 --repeats 1 --work DIR --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import device_name  # noqa: E402

from torchtitan_speechlm.codecs import load_codec  # noqa: E402
from torchtitan_speechlm.codecs.fitting import FITTERS, FitSettings  # noqa: E402
from torchtitan_speechlm.codecs.kmeans import GRIFFIN_LIM_ITERS, log_mel_distance  # noqa: E402
from torchtitan_speechlm.commands.prepare_args import build_parser as prepare_parser  # noqa: E402
from torchtitan_speechlm.demo import grammar  # noqa: E402
from torchtitan_speechlm.demo.assets import synthesize_corpus  # noqa: E402
from torchtitan_speechlm.demo.speaking import SPEED, VOICE, CorpusPlan  # noqa: E402
from torchtitan_speechlm.judges.dnsmos import DNSMOSJudge  # noqa: E402
from torchtitan_speechlm.judges.pocketsphinx_asr import PocketsphinxJudge  # noqa: E402
from torchtitan_speechlm.judges.text_scoring import item_errors, normalise_text  # noqa: E402
from torchtitan_speechlm.prepare.run import fit_or_reuse_codec  # noqa: E402
from torchtitan_speechlm.prepare.sources.jsonl import read_jsonl_manifest  # noqa: E402
from torchtitan_speechlm.utils.audio import load_audio  # noqa: E402

DNSMOS_WINDOW_S = 9.01  # speechmos.dnsmos.INPUT_LENGTH
MOS_KEYS = ("dnsmos_ovrl", "dnsmos_sig", "dnsmos_bak")
MOS_MARGIN = 0.05
OLD_MOMENTUM, OLD_ITERS = 0.99, 48


def legacy_decode(codec, codes: np.ndarray) -> np.ndarray:
    """The k-means decode as it was before decode_batch (commit 896967e), for the comparison:
    NNLS magnitudes, then 48 iterations of fast Griffin-Lim through torch.istft/stft."""
    with torch.inference_mode():
        mel = torch.exp(codec.log_mel(codes)).T
        fb = codec.features.fb
        mag = (codec._pinv @ mel).clamp(min=1e-6)
        for _ in range(10):
            mag = mag * (fb.T @ mel) / (fb.T @ (fb @ mag) + 1e-9)
        mag = torch.cat([mag, mag[:, -1:]], 1)
        feat, cfg = codec.features, codec.cfg
        length = mel.shape[1] * codec.samples_per_frame
        gen = torch.Generator().manual_seed(0)
        angles = torch.exp(2j * torch.pi * torch.rand(mag.shape, generator=gen))
        prev = torch.zeros_like(angles)

        def istft(spec):
            return torch.istft(spec, cfg.n_fft, cfg.hop_length, window=feat.window, center=True,
                               length=length)  # fmt: skip

        for _ in range(OLD_ITERS):
            rebuilt = feat.stft(istft(mag * angles))
            angles = rebuilt - prev * (OLD_MOMENTUM / (1 + OLD_MOMENTUM))
            angles = angles / (angles.abs() + 1e-16)
            prev = rebuilt
        return istft(mag * angles).float().numpy()


def stream_decode(codec, codes: np.ndarray, chunk: int) -> np.ndarray:
    dec = codec.stream_decoder()
    parts = [dec.push(codes[i : i + chunk]) for i in range(0, len(codes), chunk)]
    return np.concatenate([*parts, dec.flush()])


# ---- corpus and codec ---------------------------------------------------------------------------
def build(a) -> dict:
    """The demo-like corpus (cached under ``--work``) and a codec fitted on it (every run)."""
    train, held = grammar.split_sentences(a.train_sentences, a.held_out, CorpusPlan.seed)
    manifests = {
        name: synthesize_corpus(
            os.path.join(a.work, name), sents, len(sents), [VOICE], speeds=(SPEED,)
        )  # fmt: skip
        for name, sents in (("train", train), ("heldout", held))
    }
    t0 = time.perf_counter()
    settings = FitSettings(a.codebooks, a.codebook_size, CorpusPlan.seed,
                           kmeans_frame_rate=a.frame_rate)  # fmt: skip
    codec_dir = fit_or_reuse_codec(
        FITTERS["kmeans"], os.path.join(a.work, "codec"), read_jsonl_manifest(manifests["train"]),
        settings, a.kmeans_seconds, overwrite=True, progress=True,
    )  # fmt: skip
    fit_s = time.perf_counter() - t0
    items = read_jsonl_manifest(manifests["heldout"])
    codec = load_codec(codec_dir)
    wavs = [load_audio(it.audio, codec.sample_rate) for it in items]
    return {"codec": codec, "dir": codec_dir, "fit_s": fit_s, "wavs": wavs,
            "texts": [it.text for it in items]}  # fmt: skip


def dnsmos_groups(lengths: list[int], rate: int) -> list[list[int]]:
    """Consecutive clips joined until each group is one DNSMOS window long (the last group
    takes any remainder)."""
    groups, cur, total = [], [], 0
    for i, n in enumerate(lengths):
        cur.append(i)
        total += n
        if total >= DNSMOS_WINDOW_S * rate:
            groups.append(cur)
            cur, total = [], 0
    if cur:
        if groups:
            groups[-1].extend(cur)
        else:
            groups.append(cur)
    return groups


# ---- judging ------------------------------------------------------------------------------------
class Judges:
    def __init__(self, texts: list[str], work: str):
        path = os.path.join(work, "grammar.jsgf")
        with open(path, "w") as f:
            f.write(grammar.jsgf())
        self.asr = PocketsphinxJudge(grammar=path)  # the demo's --judge-grammar
        self.mos = DNSMOSJudge()
        self.texts = texts
        self.words = np.array([len(normalise_text(t).split()) for t in texts])

    def __call__(self, wavs: list[np.ndarray], rate: int, groups: list[list[int]]) -> dict:
        hyps = [self.asr.transcribe(w, rate) for w in wavs]
        errors = np.array([round(item_errors(r, h)["wer"] * n)
                           for r, h, n in zip(self.texts, hyps, self.words, strict=True)])  # fmt: skip
        scores = [self.mos.score(np.concatenate([wavs[i] for i in g]), rate) for g in groups]
        return {"errors": errors, **{k: np.array([s[k] for s in scores]) for k in MOS_KEYS}}


def paired_ci(diff_fn, n: int, rng: np.random.Generator, resamples: int = 2000) -> list[float]:
    idx = rng.integers(0, n, (resamples, n))
    stats = np.array([diff_fn(i) for i in idx])
    return [float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))]


def compare(row: dict, ref: dict, words: np.ndarray) -> dict:
    """Paired differences ``row - ref`` with 95% bootstrap intervals, and the verdict."""
    rng = np.random.default_rng(0)
    e, r = row["errors"], ref["errors"]
    d_wer = float((e.sum() - r.sum()) / words.sum())
    wer_ci = paired_ci(lambda i: (e[i].sum() - r[i].sum()) / words[i].sum(), len(e), rng)
    out = {"d_wer": d_wer, "d_wer_ci": wer_ci, "same": wer_ci[0] <= 0.0}
    for k in MOS_KEYS:
        d = row[k] - ref[k]
        ci = paired_ci(lambda i, d=d: d[i].mean(), len(d), rng)
        out[f"d_{k}"], out[f"d_{k}_ci"] = float(d.mean()), ci
        out["same"] = bool(out["same"] and (ci[1] >= 0.0 or d.mean() > -MOS_MARGIN))
    return out


def spectral_convergence(codec, codes: list[np.ndarray], wavs: list[np.ndarray]) -> float:
    """Mean over clips of || |STFT(decoded)| - target || / || target || (the target: the
    magnitudes Griffin-Lim is given)."""
    vals = []
    with torch.inference_mode():
        for c, w in zip(codes, wavs, strict=True):
            target = codec.magnitude(c)
            target = torch.cat([target, target[-1:]])
            got = codec.features.stft(torch.from_numpy(w)).abs().T
            vals.append(float((got - target).norm() / target.norm()))
    return float(np.mean(vals))


# ---- timing -------------------------------------------------------------------------------------
def interleaved(calls: dict, repeats: int) -> tuple[dict, dict]:
    """Wall and process CPU seconds of each call, run A, B, C, ... ``repeats`` times after a
    warm-up round."""
    for f in calls.values():
        f()
    wall: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for k, f in calls.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return wall, cpu


def set_gl(codec, iters: int, momentum: float) -> None:
    codec.griffin_lim_iters, codec.griffin_lim_momentum = iters, momentum


def build_parser() -> argparse.ArgumentParser:
    pp = prepare_parser()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-sentences", type=int, default=2000, help="the demo's (demo/run.py)")
    p.add_argument("--held-out", type=int, default=200, help="held-out sentences judged")
    p.add_argument("--kmeans-seconds", type=float, default=CorpusPlan.kmeans_seconds)
    p.add_argument("--frame-rate", type=float, default=float(CorpusPlan.frame_rate))
    p.add_argument("--codebooks", type=int, default=pp.get_default("codebooks"))
    p.add_argument("--codebook-size", type=int, default=pp.get_default("codebook_size"))
    p.add_argument("--iters", default="4,8,16,32,48", help="Griffin-Lim iteration counts")
    p.add_argument("--repeats", type=int, default=5, help="timing: interleaved runs of each")
    p.add_argument("--stream-chunk", type=int, default=1, help="frames per stream push")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: what 2 shared, busy cores time reliably; 0: torch's)",
    )
    p.add_argument(
        "--speed-only",
        action="store_true",
        help="time again, keeping --out's quality table and chosen count",
    )
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "speechlm_bench_codec"))
    p.add_argument("--out", default="benchmarks/results/codec_decode_cpu.json")
    return p


def measure_quality(a, corpus: dict, codes: list[np.ndarray]) -> dict:
    """The WER/DNSMOS table of every decode setting, and the chosen iteration count."""
    codec, wavs, rate = corpus["codec"], corpus["wavs"], corpus["codec"].sample_rate
    iters = sorted({int(x) for x in a.iters.split(",")} | {48})
    groups = dnsmos_groups([len(w) for w in wavs], rate)
    judges = Judges(corpus["texts"], a.work)
    print(f"{len(wavs)} held-out clips ({sum(map(len, wavs)) / rate:.0f} s), "
          f"{len(groups)} DNSMOS groups", flush=True)  # fmt: skip

    decodes = {"recording": lambda: wavs, "old decode (fast GL, 48)":
               lambda: [legacy_decode(codec, c) for c in codes]}  # fmt: skip
    for method, momentum in (("classic", 0.0), ("fast", 0.99)):
        for n in iters:

            def run(n=n, momentum=momentum):
                set_gl(codec, n, momentum)
                return codec.decode_batch(codes)

            decodes[f"{method} GL, {n}"] = run
    rows: dict[str, dict] = {}
    for name, fn in decodes.items():
        t0 = time.perf_counter()
        out = fn()
        judged = judges(out, rate, groups)
        rows[name] = {"wavs": out, **judged}
        print(f"{name}: WER {judged['errors'].sum() / judges.words.sum():.4f}, DNSMOS "
              f"{judged['dnsmos_ovrl'].mean():.3f} ({time.perf_counter() - t0:.0f}s)", flush=True)  # fmt: skip

    def entry(name: str, row: dict) -> dict:
        return {
            "setting": name,
            "wer": float(row["errors"].sum() / judges.words.sum()),
            **{k: float(row[k].mean()) for k in MOS_KEYS},
            "log_mel_db": float(
                np.mean(
                    [
                        log_mel_distance(w, y[: len(w)])
                        for w, y in zip(wavs, row["wavs"], strict=True)
                    ]
                )
            ),  # fmt: skip
        }

    refs = {"classic48": rows["classic GL, 48"], "old": rows["old decode (fast GL, 48)"]}
    table = []
    for name, row in rows.items():
        e = entry(name, row)
        if name != "recording":
            e["spectral_convergence"] = spectral_convergence(codec, codes, row["wavs"])
            e["vs"] = {k: compare(row, ref, judges.words) for k, ref in refs.items()}
        table.append(e)
    verdicts = {e["setting"]: e.get("vs") for e in table}
    passing = [n for n in iters if all(v["same"] for v in verdicts[f"fast GL, {n}"].values())]
    chosen = min(passing) if passing else 48
    vs_classic = [n for n in iters if verdicts[f"fast GL, {n}"]["classic48"]["same"]]

    # streaming at the chosen count, judged the same way
    set_gl(codec, chosen, 0.99)
    stream_wavs = [stream_decode(codec, c, a.stream_chunk) for c in codes]
    row = {"wavs": stream_wavs, **judges(stream_wavs, rate, groups)}
    e = entry(f"stream ({a.stream_chunk} frame/push), fast GL, {chosen}", row)
    batch = codec.decode_batch(codes)
    e["log_mel_db_vs_batch"] = float(np.mean([log_mel_distance(b, x)
                                              for b, x in zip(batch, stream_wavs, strict=True)]))  # fmt: skip
    e["spectral_convergence"] = spectral_convergence(codec, codes, stream_wavs)
    e["vs"] = {k: compare(row, ref, judges.words) for k, ref in refs.items()}
    table.append(e)
    return {
        "held_out": {
            "clips": len(wavs),
            "seconds": sum(map(len, wavs)) / rate,
            "words": int(judges.words.sum()),
            "dnsmos_groups": len(groups),
        },  # fmt: skip
        "judges": {"asr": judges.asr.describe(), "quality": judges.mos.describe()},
        "rule": "fewest fast-GL iterations whose paired 95% bootstrap interval of WER "
        "difference reaches 0 and, for DNSMOS ovrl/sig/bak, reaches 0 or has a mean "
        f"difference above -{MOS_MARGIN}, against classic GL 48 and the old decode",
        "quality": table,
        "passing_iters": passing,
        "passing_iters_vs_classic48_only": vs_classic,
        "chosen_iters": chosen,
    }


def measure_speed(a, codec, codes: list[np.ndarray], chosen: int) -> dict:
    """RTF of the old decode and the new one (batch 1, batch 8, stream), interleaved."""
    clips = codes[:8]
    audio_s = sum(len(c) for c in clips) * codec.samples_per_frame / codec.sample_rate

    def new(n, batch):
        def f():
            set_gl(codec, n, 0.99)
            return codec.decode_batch(clips) if batch else [codec.decode(c) for c in clips]

        return f

    def stream(chunk):
        def f():
            set_gl(codec, chosen, 0.99)
            return [stream_decode(codec, c, chunk) for c in clips]

        return f

    calls = {
        "old": lambda: [legacy_decode(codec, c) for c in clips],
        "new_48_batch1": new(48, False), "new_48_batch8": new(48, True),
        f"new_{chosen}_batch1": new(chosen, False), f"new_{chosen}_batch8": new(chosen, True),
        **{f"stream_{chosen}_chunk{k}": stream(k) for k in (a.stream_chunk, 4)},
    }  # fmt: skip
    load = os.getloadavg()
    wall, cpu = interleaved(calls, a.repeats)
    med = {k: statistics.median(v) for k, v in wall.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    out = {k: {"median_s": med[k], "rtf": med[k] / audio_s, "spread_s": [min(v), max(v)],
               "cpu_median_s": cpu_med[k], "rtf_cpu": cpu_med[k] / audio_s}
           for k, v in wall.items()}  # fmt: skip
    return {
        "device": device_name("cpu"),
        "threads": torch.get_num_threads(),
        "loadavg_start_end": [list(load), list(os.getloadavg())],
        "clips": len(clips),
        "audio_seconds": audio_s,
        "repeats": a.repeats,
        "stream_chunk_frames": a.stream_chunk,
        **out,
        "speedup_vs_old": {k: med["old"] / med[k] for k in med if k != "old"},
        "speedup_vs_old_cpu": {k: cpu_med["old"] / cpu_med[k] for k in cpu_med if k != "old"},
    }


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    os.makedirs(a.work, exist_ok=True)
    corpus = build(a)
    codec = corpus["codec"]
    codes = codec.encode(corpus["wavs"])
    print(f"codec ready in {corpus['fit_s']:.1f}s (prepare refits only on other settings)")
    if a.speed_only:
        with open(a.out) as f:
            result = json.load(f)
    else:
        result = {
            "what": "k-means codec decode: WER/DNSMOS vs Griffin-Lim iterations; RTF vs the "
            "old decode",
            "quality_threads": torch.get_num_threads(),
            "codec": {
                "frame_rate": codec.frame_rate,
                "hop": codec.samples_per_frame,
                "n_fft": codec.cfg.n_fft,
                "codebooks": codec.num_streams,
                "codebook_size": codec.codebook_size,
                "fit_seconds": a.kmeans_seconds,
                "fit_frames": json.load(open(os.path.join(corpus["dir"], "config.json")))[
                    "fit_frames"
                ],
                "config_hash": codec.config_hash,
            },  # fmt: skip
            **measure_quality(a, corpus, codes),
        }
        print("\n| setting | WER | DNSMOS ovrl | sig | bak | log-mel dB | SC |")
        for e in result["quality"]:
            print(f"| {e['setting']} | {e['wer']:.3f} | {e['dnsmos_ovrl']:.3f} "
                  f"| {e['dnsmos_sig']:.3f} | {e['dnsmos_bak']:.3f} | {e['log_mel_db']:.2f} | "
                  f"{e.get('spectral_convergence', float('nan')):.3f} |")  # fmt: skip
    chosen = result["chosen_iters"]
    print(f"chosen: {chosen} (passing {result['passing_iters']}); "
          f"the code's default: {GRIFFIN_LIM_ITERS}")  # fmt: skip
    result["speed"] = measure_speed(a, codec, codes, chosen)
    sp = result["speed"]
    print(json.dumps({"rtf": {k: round(sp[k]["rtf"], 4) for k in sp["speedup_vs_old"] | {"old": 0}},
                      "speedup_vs_old": {k: round(v, 2) for k, v in sp["speedup_vs_old"].items()},
                      "speedup_vs_old_cpu": {k: round(v, 2)
                                             for k, v in sp["speedup_vs_old_cpu"].items()}}))  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
