"""``CodecIdentity``: which codec made a dataset's audio codes, typed once and carried whole.

The codec of a prepared dataset is recorded by ``torchtitan prepare`` in its metadata.json
(``codec``: name, folder, class, sample and frame rates, streams kept and in all, codebook size,
config hash). It is read into this value once, where the dataset's metadata is read
(data/catalog.py, data/reader.py), and the same value travels to what needs it: the vocabulary
layout (streams, codebook size), the data's frame rate, the run record, each checkpoint's
identity, exports, and generation, which loads the codec from ``path`` (or an export's copy,
``folder``). Two identities mean the same codes when their ``config_hash`` is the same
(``same_codes``); a record without a hash (older runs, a Python data object that knows none)
cannot be compared.

``to_dict`` writes the keys metadata.json has always had, in its order, so a prepared dataset's
metadata.json keeps its shape; the optional keys (``path``, ``class``, ``sample_rate``,
``total_streams``, ``folder``) are left out where unknown (a Python data object's codec).
"""

from __future__ import annotations

from dataclasses import dataclass

# metadata.json's key -> the field (``class`` is a keyword)
_KEYS = {
    "name": "name",
    "path": "path",
    "class": "codec_class",
    "sample_rate": "sample_rate",
    "frame_rate": "frame_rate",
    "num_streams": "num_streams",
    "total_streams": "total_streams",
    "codebook_size": "codebook_size",
    "config_hash": "config_hash",
    "folder": "folder",
}
_OPTIONAL = ("path", "class", "sample_rate", "total_streams", "folder")
# what must agree for two datasets' codes to mix (and for a shard to belong to its dataset)
COMPATIBLE = ("name", "num_streams", "codebook_size", "config_hash", "frame_rate")


@dataclass(frozen=True)
class CodecIdentity:
    name: str = ""
    """The codec's registered name (``encodec``, ``kmeans``, ... ; ``espnet:IO`` for ESPnet's)."""
    path: str = ""
    """The codec folder the data was encoded with (absolute), "" where unknown."""
    codec_class: str = ""
    """The class that implements it (metadata.json's ``class``)."""
    sample_rate: int = 0
    """Waveform samples per second it encodes (0: unknown)."""
    frame_rate: float = 0.0
    """Code frames per second."""
    num_streams: int = 0
    """Codebooks kept (the vocabulary's audio streams)."""
    total_streams: int = 0
    """Codebooks of the codec in all (0: unknown; ``num_streams`` kept, coarse first)."""
    codebook_size: int = 0
    """Codes per codebook (every stream the same)."""
    config_hash: str = ""
    """Hash of the codec's config and weights: two codecs with one hash make the same codes."""
    folder: str = ""
    """An export's copy of the codec folder, relative to the export ("" elsewhere)."""

    @classmethod
    def from_dict(cls, data: dict | None) -> CodecIdentity:
        """From a metadata.json / run record / export / checkpoint identity ``codec`` entry
        (keys it lacks stay unknown: older files recorded fewer). Values are taken as written
        (a frame rate of 50 stays the int JSON holds, so the entry written back is the same)."""
        data = data or {}
        return cls(**{f: data[k] for k, f in _KEYS.items() if data.get(k) is not None})

    @classmethod
    def of_codec(cls, codec, num_streams: int | None = None) -> CodecIdentity:
        """The identity of a loaded codec (codecs/base.py ``Codec``), ``num_streams`` of its
        codebooks kept (default: those it keeps)."""
        return cls(
            name=codec.name,
            path=codec.path,
            codec_class=codec.class_name,
            sample_rate=codec.sample_rate,
            frame_rate=codec.frame_rate,
            num_streams=codec.num_streams if num_streams is None else num_streams,
            total_streams=codec.total_streams,
            codebook_size=codec.codebook_size,
            config_hash=codec.config_hash,
        )

    def to_dict(self) -> dict:
        """metadata.json's ``codec`` entry (its keys and order; unknown optional ones left out)."""
        out = {}
        for key, field_name in _KEYS.items():
            value = getattr(self, field_name)
            if key in _OPTIONAL and not value:
                continue
            out[key] = value
        return out

    def value_of(self, key: str):
        """The value of metadata.json's key ``key`` (``class``, ``num_streams``, ...)."""
        return getattr(self, _KEYS[key])

    def difference(self, other: CodecIdentity, keys: tuple[str, ...] = COMPATIBLE) -> str | None:
        """The first of ``keys`` (metadata.json's names) whose value differs, or None."""
        return next((k for k in keys if self.value_of(k) != other.value_of(k)), None)

    def same_codes(self, other: CodecIdentity) -> bool | None:
        """Whether the two made the same codes: their hashes agree (True) or differ (False);
        None when either records no hash."""
        if not self.config_hash or not other.config_hash:
            return None
        return self.config_hash == other.config_hash

    def describe(self, datasets: dict | None = None) -> str:
        """``encodec (config_hash 4806d537bd4d07ec, /path/codec; datasets tiny=/path)``."""
        where = f", {self.path}" if self.path else ""
        data = ", ".join(f"{k}={v}" for k, v in (datasets or {}).items())
        data = f"; datasets {data}" if data else ""
        return f"{self.name or '?'} (config_hash {self.config_hash or '?'}{where}{data})"

    def located(self, folder: str) -> CodecIdentity:
        """The same codec with an export's copy at ``folder`` (relative to the export)."""
        return CodecIdentity(**{**self.__dict__, "folder": folder})
