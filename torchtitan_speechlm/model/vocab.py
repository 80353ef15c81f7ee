"""The extended vocabulary: special tokens | text | audio stream 0 | audio stream 1 | ...

One embedding table holds every token. Each audio stream owns a contiguous block made of its pad
token followed by its codebook. The layout is a pure function of
(specials, text size, number of streams, codebook size), built in one fixed order, never from dict
or TOML key order, and it is stored with every run and checkpoint (``vocab.json``): loading with a
different layout is an error, never a silent remap (ESPnet once trained with a reordered vocabulary
and reported CE 55.7 instead of 2.1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from torchtitan_speechlm.utils.fileio import (
    DamagedFileError,
    json_hash,
    read_checked_json,
    write_checked_json,
)

NUM_SPECIAL = 64
_NAMED_SPECIALS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|eot|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|text|>",
    "<|audio|>",
    "<|cfg_drop|>",
)
SPECIAL_TOKENS: tuple[str, ...] = _NAMED_SPECIALS + tuple(
    f"<|reserved_{i}|>" for i in range(len(_NAMED_SPECIALS), NUM_SPECIAL)
)
LAYOUT_VERSION = 1


class VocabMismatchError(ValueError):
    """Raised when a run, checkpoint or dataset was built with another vocabulary layout."""


REWRITE = (
    "It is the run's record of its vocabulary layout; delete {path} and rerun (the run writes "
    "it again; every checkpoint's data position carries the layout's fingerprint, which is "
    "still checked), or restore it from a copy"
)


@dataclass(frozen=True)
class VocabLayout:
    text_size: int
    num_streams: int
    codebook_size: int
    specials: tuple[str, ...] = field(default=SPECIAL_TOKENS)
    version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if self.text_size <= 0:
            raise ValueError(f"text_size must be > 0, got {self.text_size}")
        if self.num_streams <= 0 or self.codebook_size <= 0:
            raise ValueError(
                f"num_streams and codebook_size must be > 0, got {self.num_streams}, "
                f"{self.codebook_size}"
            )

    # ---- ids -------------------------------------------------------------------------------
    def special(self, name: str) -> int:
        return self.specials.index(name)

    @property
    def pad(self) -> int:
        return self.special("<|pad|>")

    @property
    def text_offset(self) -> int:
        return len(self.specials)

    def text(self, token_id: int) -> int:
        return self.text_offset + token_id

    def stream_offset(self, k: int) -> int:
        """Id of stream k's pad token; its codes follow."""
        return self.text_offset + self.text_size + k * (self.codebook_size + 1)

    def stream_pad(self, k: int) -> int:
        return self.stream_offset(k)

    def pad_frame(self) -> list[int]:
        """The all-padding frame: the text pad in stream 0, each codebook's pad in the others."""
        return [self.pad] + [self.stream_pad(k) for k in range(1, self.num_streams)]

    def code(self, k: int, c: int) -> int:
        return self.stream_offset(k) + 1 + c

    @property
    def size(self) -> int:
        return self.stream_offset(self.num_streams)

    def stream_range(self, k: int) -> tuple[int, int]:
        """[start, end) of the ids stream k can predict.

        Stream 0 carries specials, text and codebook 0; stream k > 0 only its pad and codebook.
        Logits are computed on these slices only, so audio streams never pay for the text vocab.
        """
        end = self.stream_offset(k) + 1 + self.codebook_size
        return (0 if k == 0 else self.stream_offset(k)), end

    # ---- persistence -----------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["specials"] = list(self.specials)
        d["size"] = self.size
        d["fingerprint"] = self.fingerprint()
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "vocab.json") -> VocabLayout:
        layout = cls(
            text_size=int(d["text_size"]),
            num_streams=int(d["num_streams"]),
            codebook_size=int(d["codebook_size"]),
            specials=tuple(d["specials"]),
            version=int(d.get("version", LAYOUT_VERSION)),
        )
        if "fingerprint" in d and d["fingerprint"] != layout.fingerprint():
            raise VocabMismatchError(f"{where}: its fingerprint does not match its own contents")
        return layout

    def fingerprint(self) -> str:
        return json_hash(
            [
                self.version,
                list(self.specials),
                self.text_size,
                self.num_streams,
                self.codebook_size,
            ]
        )

    def check_same(self, other: VocabLayout, where: str) -> None:
        """Raise a VocabMismatchError naming the first differing field."""
        for key in ("version", "text_size", "num_streams", "codebook_size", "specials"):
            a, b = getattr(self, key), getattr(other, key)
            if a != b:
                shown = (a, b) if key != "specials" else ("<specials list>", "<specials list>")
                raise VocabMismatchError(
                    f"vocabulary layout mismatch with {where}: {key} is {shown[1]} there but "
                    f"{shown[0]} in this run. Use the same backbone, tokenizer and codec as the "
                    "run that produced it (or start a fresh dump_folder)."
                )

    def save(self, path: str | Path) -> None:
        write_checked_json(str(path), self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> VocabLayout:
        """The layout saved at ``path``; VocabMismatchError naming the file when it is damaged
        (its checksum, its JSON) or incomplete."""
        try:
            d = read_checked_json(str(path))
            return cls.from_dict(d, str(path))
        except DamagedFileError as e:
            raise VocabMismatchError(f"{e}. {REWRITE.format(path=path)}") from None
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, VocabMismatchError):
                raise
            raise VocabMismatchError(f"{path} is damaged: {type(e).__name__}: {e}. "
                                     f"{REWRITE.format(path=path)}") from None  # fmt: skip
