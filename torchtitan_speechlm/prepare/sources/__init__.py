"""Prepare sources: one module per corpus format (JSONL manifest, Kaldi data dir, HF datasets
on disk, lhotse cuts, Lhotse Shar, preference pairs), each turning its input into ManifestItems
and registering itself."""

from torchtitan_speechlm.prepare.sources.base import (
    SOURCES,
    PrepareSource,
    SourceOption,
    SourceRead,
    register_source,
)

# registration order = the order of the CLI flags
# isort: off
from torchtitan_speechlm.prepare.sources import jsonl, kaldi, hf, lhotse, lhotse_shar  # noqa: F401, E402
from torchtitan_speechlm.prepare.sources import preference  # noqa: F401, E402
# isort: on


def read_source(name: str, path: str, options: dict | None = None) -> SourceRead:
    """Read a registered source; ``options`` are its SourceOptions by name."""
    src = SOURCES.get(name, "source")
    known = {o.name: o.default for o in src.options}
    unknown = set(options or {}) - set(known)
    if unknown:
        raise ValueError(
            f"source {name!r} takes no option(s) {sorted(unknown)}; its options: "
            f"{sorted(known) or 'none'}"
        )
    return src.read(path, **{**known, **(options or {})})


__all__ = [
    "SOURCES",
    "PrepareSource",
    "SourceOption",
    "SourceRead",
    "read_source",
    "register_source",
]
