"""``torchtitan prepare``: turn a corpus (JSONL manifest, Kaldi dir, HF dataset on disk, lhotse cuts
or Shar) into a prepared dataset (docs/data.md).

    torchtitan prepare --manifest train.jsonl --codec CODEC --tokenizer TOK --out-dir data/prepared

``prepare(PrepareArgs)`` is the command as a Python function (``torchtitan prefer`` calls it);
``main(argv)`` parses a command line into a ``PrepareArgs`` (commands/prepare_args.py) and calls
it. The work is prepare/pipeline.py's ``prepare_dataset`` (and ``join_parts``).
"""

from __future__ import annotations

import argparse
import os
import sys

from torchtitan_speechlm.codecs import CodecError
from torchtitan_speechlm.commands.prepare_args import (
    PrepareArgs,
    UsageError,
    build_parser,
    named_imports,
)
from torchtitan_speechlm.data.format import CorruptDatasetError
from torchtitan_speechlm.data.remote import RemoteDatasetError, is_url, staging_folder, upload
from torchtitan_speechlm.prepare.pipeline import (
    NoItemsError,
    format_summary,
    join_parts,
    prepare_dataset,
)
from torchtitan_speechlm.prepare.plan import PlanMismatchError
from torchtitan_speechlm.prepare.split import SplitError, describe_split
from torchtitan_speechlm.prepare.waveforms import add_waveforms, describe
from torchtitan_speechlm.prepare.worker import import_modules
from torchtitan_speechlm.utils.audio import BadAudioError
from torchtitan_speechlm.utils.progress import Progress


def main(argv: list[str] | None = None) -> int:
    """CLI entry point for ``torchtitan prepare``; returns the exit status."""
    import_extensions(argv)  # their sources are flags of the parser
    return run(build_parser().parse_args(argv))


def run(parsed: argparse.Namespace) -> int:
    """``torchtitan prepare`` of a parsed command line (the console script parses one that names
    no ``--import`` modules before it imports this module, and with it torch)."""
    try:
        return prepare(PrepareArgs.from_namespace(parsed))
    except UsageError as e:
        build_parser().error(str(e))


def prepare(args: PrepareArgs) -> int:
    """``torchtitan prepare``: prepare ``args.out_dir`` from the source (or join the parts of
    ``args.join``); the exit status (1: an error, said on stderr). A ``UsageError`` (no
    ``--tokenizer`` or ``--out-dir``; ``--staging`` without a URL) is raised."""
    import_modules(args.imports)  # the sources and codecs they register, before the checks
    try:
        args.validate()
    except UsageError:
        raise
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.join is not None:
        try:
            print(format_summary(join_parts(args.join)))
        except (OSError, ValueError, CorruptDatasetError, NoItemsError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    url = args.out_dir.rstrip("/") if is_url(args.out_dir) else None
    out_dir = (args.staging or staging_folder(url)) if url is not None else args.out_dir
    said = Progress("prepare", not args.no_progress).start()  # between its own lines
    said.status = f"preparing {out_dir}: reading the source, checking the tokenizer, the codec"
    try:
        s = prepare_dataset(
            None, args.codec, args.tokenizer, out_dir, batch_size=args.codec_batch_size,
            device=args.device, progress=not args.no_progress, overwrite=args.overwrite,
            source=(args.source, args.sources[args.source]),
            source_options=args.options_of_source(), imports=tuple(args.imports),
            workers=args.workers,
            shard_size=args.shard_size, num_streams=args.num_streams, strict=args.strict,
            allow_audio_only=args.allow_audio_only, fit_kmeans_codec=args.fit_kmeans_codec,
            fit_mel_codec=args.fit_mel_codec, fit_world_codec=args.fit_world_codec,
            mel_stack=args.mel_stack,
            codebooks=args.codebooks, codebook_size=args.codebook_size,
            kmeans_seconds=args.kmeans_seconds, kmeans_frame_rate=args.kmeans_frame_rate,
            seed=args.seed,
            allow_lossy_tokenizer=args.allow_lossy_tokenizer,
            dev_fraction=args.dev_fraction, dev_seed=args.dev_seed or 0, part=args.part,
        )  # fmt: skip
        parts = [(out_dir, s)] if args.dev_fraction is None else [
            (os.path.join(out_dir, n), s[n]) for n in ("train", "dev")]  # fmt: skip
        if args.waveforms:  # by the part that joined (waveforms of a --join: see docs/data.md)
            for out, _ in [(o, x) for o, x in parts if x.get("complete") is not False]:
                print(describe(out, add_waveforms(out, args.sources["manifest"], args.waveforms)))
        for out, summary in parts if url is not None else ():
            if summary.get("complete") is not False:  # the part that joined uploads the dataset
                dest = url + out[len(out_dir) :].replace(os.sep, "/")
                put = upload(out, dest)
                print(f"prepare: uploaded {out} to {dest} ({put} files; metadata.json last)")
    except (OSError, ValueError, ImportError, CodecError, BadAudioError, CorruptDatasetError,
            PlanMismatchError, NoItemsError, SplitError, RemoteDatasetError) as e:  # fmt: skip
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        said.stop()
    for _, summary in parts:
        print(format_summary(summary))
    if args.dev_fraction is not None and all("num_items" in s[n] for n in ("train", "dev")):
        print(describe_split(s["split"], {n: s[n]["num_items"] for n in ("train", "dev")}))
    return 0


def import_extensions(argv: list[str] | None) -> list[str]:
    """Import the ``--import MODULE`` modules of a ``torchtitan prepare`` command line (first:
    the sources they register become flags of the full parser); returns their names.

    A module is found as ``python -m`` finds it: in the current directory first. The console
    script's ``sys.path[0]`` is its own bin/ folder, not the current directory, so that is
    put on ``sys.path`` here (and stays there: worker processes start with this ``sys.path``
    and import the modules again)."""
    imports = named_imports(argv)
    if imports:
        cwd = os.getcwd()
        if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
            sys.path.insert(0, cwd)
    import_modules(imports)
    return imports


if __name__ == "__main__":
    sys.exit(main())
