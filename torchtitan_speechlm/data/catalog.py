"""``[speechlm_data]``'s datasets, training mixture and validation sets, resolved once.

``DataCatalog.from_config`` reads the section's ``datasets`` (``NAME=PATH``), ``train``
(``TASK:NAME[:WEIGHT]``), ``valid`` (``[SET=]TASK:NAME``), ``valid_fraction`` and
``verify_shards``, reads each dataset's metadata.json once (``DatasetRef``: its codec typed) and checks that they
share one codec layout and tokenizer. ``sources`` opens the datasets of a mixture for a split: ``train`` (the
items not held out), ``valid`` (held out by id hash) or ``all``. A Python data object (the
Python API's ESPnet iterators, data/external.py) gives a catalog with its codec and named
validation sets and no prepared datasets (``DataCatalog.external``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from torchtitan_speechlm.config import ConfigError
from torchtitan_speechlm.data.format import check_compatible, codec_of, id_hash, parse_metadata
from torchtitan_speechlm.data.mixing import AllItems, Source
from torchtitan_speechlm.data.reader import PreparedDataset
from torchtitan_speechlm.data.remote import Mirror, RemoteCache, is_url, local_path
from torchtitan_speechlm.data.tasks import TASKS
from torchtitan_speechlm.model.codec_identity import CodecIdentity
from torchtitan_speechlm.utils.upstream import logger

SPLITS = ("train", "valid", "all", "external")


@dataclass(frozen=True)
class MixEntry:
    task: str
    dataset: str
    weight: float


def parse_datasets(specs: list[str]) -> dict[str, str]:
    """``["NAME=PATH", ...]`` -> ``{NAME: PATH}`` (names unique)."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(
                f"speechlm_data.datasets entry {spec!r} must look like NAME=PATH "
                "(a directory made by `torchtitan prepare`)."
            )
        if name in out:
            raise ConfigError(f"speechlm_data.datasets names {name!r} twice")
        out[name] = path
    return out


def parse_mix(specs: list[str], key: str, names: dict[str, str]) -> list[MixEntry]:
    """``TASK:NAME[:WEIGHT]`` entries of ``speechlm_data.{key}`` over the named datasets."""
    entries = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"speechlm_data.{key} entry {spec!r} must be TASK:NAME[:WEIGHT]")
        task, name = parts[0], parts[1]
        if task not in TASKS:
            try:
                TASKS.get(task)
            except ValueError as e:
                raise ConfigError(f"speechlm_data.{key} entry {spec!r}: {e}") from None
        if name not in names:
            raise ConfigError(
                f"speechlm_data.{key} entry {spec!r}: no dataset named {name!r}; add "
                f"`{name}=PATH` to speechlm_data.datasets (known: {sorted(names)})"
            )
        try:
            weight = float(parts[2]) if len(parts) == 3 else 1.0
        except ValueError:
            raise ConfigError(
                f"speechlm_data.{key} entry {spec!r}: weight is not a number"
            ) from None
        if weight <= 0:
            raise ConfigError(f"speechlm_data.{key} entry {spec!r}: weight must be > 0")
        entries.append(MixEntry(task, name, weight))
    return entries


def read_dataset_metadata(path: str, remote: RemoteCache | None = None) -> dict:
    """A dataset's metadata.json (at a URL: fetched into its mirror, data/remote.py)."""
    if is_url(path):
        data = Mirror(path, remote).metadata()
    else:
        meta = Path(path) / "metadata.json"
        if not meta.is_file():
            raise ConfigError(
                f"prepared dataset {path!r} has no metadata.json; create it with "
                "`torchtitan prepare --manifest M.jsonl --codec DIR --tokenizer DIR --out-dir "
                f"{path}`."
            )
        data = meta.read_bytes()
    # the run needs the codec, tokenizer and totals; each shard's record (a few hundred bytes
    # of objects per 1000 items) is the reader's business (data/reader.py)
    return copy.deepcopy({k: v for k, v in parse_metadata(data).items() if k != "shards"})


@dataclass(frozen=True)
class DatasetRef:
    """One prepared dataset of ``speechlm_data.datasets``, its metadata.json read once: the
    name the mixture uses, the path as given (a folder or an fsspec URL), its codec (typed:
    model/codec_identity.py), its text tokenizer's fingerprint and the rest of the record
    (waveforms, the tokenizer check, totals; not the shards', which the reader owns)."""

    name: str
    path: str
    codec: CodecIdentity
    tokenizer: dict
    metadata: dict

    @classmethod
    def read(cls, name: str, path: str, remote: RemoteCache | None = None) -> DatasetRef:
        meta = read_dataset_metadata(path, remote)
        return cls(name, path, codec_of(meta), dict(meta.get("tokenizer") or {}), meta)

    @property
    def local(self) -> str:
        """The path as the run records it (absolute; a URL unchanged)."""
        return local_path(self.path)

    @property
    def waveform(self) -> dict | None:
        """Its waveforms' record (prepare/waveforms.py), None without."""
        return self.metadata.get("waveform") or None


@dataclass(frozen=True)
class DataCatalog:
    refs: dict[str, DatasetRef]  # name -> the prepared dataset ({}: a Python data object)
    codec: CodecIdentity  # every dataset's (checked to be the same), or the data object's
    tokenizer: dict  # the text tokenizer's fingerprint (``tokenizer_fingerprint``)
    train: list[MixEntry]
    valid: dict[str, tuple[list[MixEntry], str]]  # set name -> (entries, split to read)
    valid_fraction: float = 0.0
    verify_shards: str = "size"
    external_names: list[str] = field(default_factory=list)
    remote: RemoteCache = RemoteCache()  # the mirror of datasets at URLs (data/remote.py)

    @classmethod
    def from_config(cls, data) -> DataCatalog:
        """The ``[speechlm_data]`` section's datasets, mixture and validation sets."""
        datasets = parse_datasets(data.datasets)
        train = parse_mix(data.train, "train", datasets)
        if not train:
            raise ConfigError("speechlm_data.train is empty: list at least one TASK:NAME entry")
        remote = RemoteCache(data.remote_cache_dir, data.remote_cache_gb)
        refs = {name: DatasetRef.read(name, p, remote) for name, p in datasets.items()}
        first = next(iter(refs.values()))
        for ref in refs.values():
            try:
                check_compatible(first.metadata, ref.metadata)
            except ValueError as e:
                raise ConfigError(
                    f"datasets {first.name!r} and {ref.name!r} cannot be mixed: {e}; prepare all "
                    "of them with the same codec (and --num-streams) and tokenizer."
                ) from None
        valid = validation_sets(data.valid, data.valid_fraction, datasets, train)
        return cls(refs, first.codec, first.tokenizer, train, valid, data.valid_fraction,
                   data.verify_shards, remote=remote)  # fmt: skip

    @classmethod
    def external(
        cls,
        codec: CodecIdentity,
        valid_names: list[str],
        text_vocab: int,
        tokenizer: dict | None = None,
    ) -> DataCatalog:
        """The catalog of a Python data object: its codec, named validation sets and text
        tokenizer (``tokenizer_fingerprint``'s dict, when the object knows it)."""
        tok = dict(tokenizer) if tokenizer else {"vocab_size": text_vocab}
        valid = {name: ([], "external") for name in valid_names}
        return cls({}, codec, tok, [], valid, external_names=list(valid_names))

    @property
    def datasets(self) -> dict[str, str]:
        """name -> path, as ``speechlm_data.datasets`` gives them."""
        return {name: ref.path for name, ref in self.refs.items()}

    @property
    def num_streams(self) -> int:
        return self.codec.num_streams

    @property
    def frame_rate(self) -> float:
        return float(self.codec.frame_rate)

    def entries(self) -> list[MixEntry]:
        """Every mixture entry the run reads: training and validation."""
        return list(self.train) + [e for es, _ in self.valid.values() for e in es]

    def check_text_vocab(self, text_size: int, backbone_path: str) -> None:
        """Every dataset's tokenizer fits the backbone's ``text_size`` embedding rows."""
        for name, ref in self.refs.items():
            tv = int(ref.tokenizer["vocab_size"])
            if tv > text_size:
                raise ConfigError(
                    f"dataset {name!r} was tokenised with {tv} text tokens but the backbone "
                    f"{backbone_path!r} has only {text_size} embedding rows; prepare it with "
                    "the backbone's tokenizer."
                )

    def open(self, name: str) -> PreparedDataset:
        """The dataset ``name``, opened (once per process: ``open_prepared``)."""
        return open_prepared(self.refs[name].path, self.verify_shards, self.remote)

    def check_held_out(self, set_name: str, entries: list[MixEntry], split: str) -> None:
        """A validation set read from the held-out part of a training dataset has items in it:
        a ``valid_fraction`` too small for the dataset holds out none, which is named here with
        the count and the smallest fraction that holds one out (else the set's stream fails
        later without naming the setting)."""
        if split != "valid":
            return
        for e in entries:
            data = self.open(e.dataset)
            if len(split_indices(data, self.valid_fraction, "valid")):
                continue
            hashes = getattr(data, "id_hashes", None)
            if hashes is None:
                hashes = [id_hash(i) for i in data.ids]
            least = float(np.min(np.asarray(hashes, dtype=np.float64))) / float(0xFFFFFFFF)
            need = np.ceil(least * 1000) / 1000 + (0.001 if least * 1000 % 1 == 0 else 0.0)
            raise ConfigError(
                f"speechlm_data.valid_fraction = {self.valid_fraction:g} holds out 0 of the "
                f"{len(data)} items of dataset {e.dataset!r}, so the validation set "
                f"{set_name!r} ({e.task}:{e.dataset}) would be empty: raise valid_fraction to "
                f"{min(need, 1.0):g} or more (the smallest that holds out one of its items), or "
                "validate on a dataset training does not use"
            )

    def sources(self, entries: list[MixEntry], split: str) -> list[Source]:
        """The mixture ``entries`` over ``split`` of their datasets (each opened once)."""
        out = []
        for e in entries:
            data = self.open(e.dataset)
            indices = split_indices(data, self.valid_fraction, split)
            out.append(Source(e.task, e.dataset, e.weight, data, indices))
        return out


def validation_sets(
    specs: list[str], valid_fraction: float, datasets: dict, train: list[MixEntry]
) -> dict[str, tuple[list[MixEntry], str]]:
    """Explicit ``valid`` entries: a dataset that training also uses is validated on its
    held-out part when ``valid_fraction`` > 0 (never on items training sees); with no hold-out
    it is validated on all its items, with a warning. A dataset training does not use: all
    items. No ``valid`` entries: every training entry on its held-out part."""
    if not specs:
        if valid_fraction > 0:
            return {f"{e.task}_{e.dataset}_heldout": ([e], "valid") for e in train}
        return {}
    trained = {e.dataset for e in train}
    sets = {}
    for spec in specs:
        name, eq, rest = spec.partition("=")
        if not eq or ":" in name:
            name, rest = "", spec
        (e,) = parse_mix([rest], "valid", datasets)
        name = name or f"{e.task}_{e.dataset}"
        if name in sets:
            raise ConfigError(
                f"speechlm_data.valid names the set {name!r} twice; name them apart with "
                "SET=TASK:NAME entries"
            )
        split = "all"
        if e.dataset in trained:
            if valid_fraction > 0:
                split = "valid"
            else:
                logger.warning(
                    f"validation set {e.task}:{e.dataset} is also training data (valid_fraction "
                    "= 0): its numbers measure fit, not generalisation; set "
                    "speechlm_data.valid_fraction > 0 to validate on held-out items"
                )
        sets[name] = ([e], split)
    return sets


def _hash01(s: str) -> float:
    return id_hash(s) / 0xFFFFFFFF


def split_indices(ids, valid_fraction: float, split: str) -> np.ndarray | AllItems:
    """Deterministic hold-out by id hash: stable across runs, ranks and dataset order.

    ``ids``: the items' ids, or a dataset whose index holds their hashes (``id_hashes``: no id
    is read). ``split`` is "train" (items not held out), "valid" (held out) or "all". Every
    item: ``AllItems`` (no array)."""
    n = len(ids)
    if split == "all":
        return AllItems(n)
    if valid_fraction <= 0:
        return AllItems(n) if split == "train" else np.arange(0)
    hashes = getattr(ids, "id_hashes", None)
    if hashes is not None:  # the same double division as _hash01, vectorised
        held = np.asarray(hashes).astype(np.float64) / float(0xFFFFFFFF) < valid_fraction
    else:
        held = np.array([_hash01(i) < valid_fraction for i in ids], dtype=bool)
    return np.nonzero(~held if split == "train" else held)[0]


def open_prepared(
    path: str, verify: str = "size", remote: RemoteCache | None = None
) -> PreparedDataset:
    """A prepared dataset is immutable once written, so each process opens (and validates,
    ``speechlm_data.verify_shards``) it once, not once per mixture entry or validation round.
    ``path``: a folder or an fsspec URL (``remote``: its mirror's settings)."""
    path = local_path(path)
    # a folder is the same dataset whatever the mirror settings: opened once
    return _open_prepared(path, verify, (remote or RemoteCache()) if is_url(path) else None)


@functools.lru_cache(maxsize=64)
def _open_prepared(path: str, verify: str, remote: RemoteCache | None) -> PreparedDataset:
    return PreparedDataset(path, verify=verify, remote=remote)
