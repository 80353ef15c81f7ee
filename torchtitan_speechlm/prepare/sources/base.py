"""The registry of prepare sources: a corpus format is one module that reads its input into
``ManifestItem``s and registers a ``PrepareSource`` (its CLI flag, options and reader).
``torchtitan prepare`` builds its source flags from this registry (docs/extending.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torchtitan_speechlm.prepare.items import ManifestItem
from torchtitan_speechlm.utils.registry import Registry


@dataclass
class SourceRead:
    """What a source reader returns."""

    items: Sequence[ManifestItem]  # a list, or prepare/spill.py's SpilledItems (on disk)
    description: dict  # recorded as "source" in plan.json and metadata.json ({"type": name, ...})
    hf_reader: tuple | None = None  # (path, audio_column, split): workers read HF rows themselves


@dataclass(frozen=True)
class SourceOption:
    """An extra keyword of a source (``--audio-column`` ...), with its default and help."""

    name: str
    default: object = None
    help: str = ""


@dataclass(frozen=True)
class PrepareSource:
    name: str  # the prepare_dataset keyword and plan.json "type"
    flag: str  # CLI flag, e.g. "--kaldi"
    metavar: str
    help: str
    read: Callable[..., SourceRead]  # read(path, **options)
    options: tuple[SourceOption, ...] = field(default=())


SOURCES: Registry[PrepareSource] = Registry("prepare source")


def register_source(source: PrepareSource) -> PrepareSource:
    return SOURCES.register(source.name, source)
