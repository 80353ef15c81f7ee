"""Each config key's documentation, read from its dataclass field docstring (the one place a key
is documented): docs/config.md's tables (tools/config_doc.py) and ``torchtitan train --help``
(commands/train_help.py) are both made from it."""

from __future__ import annotations

import ast
import inspect
import json
from dataclasses import MISSING, fields

from torchtitan_speechlm.config.job_config import (
    AudioEncoderConfig,
    Checkpoint,
    Lora,
    LRScheduler,
    Metrics,
    SpeechLM,
    SpeechLMData,
    SpeechLMFaults,
)

SECTIONS = (  # ours, in the order the docs and the help show them
    ("speechlm", SpeechLM),
    ("speechlm_data", SpeechLMData),
    ("speechlm_faults", SpeechLMFaults),
    ("checkpoint", Checkpoint),
    ("lr_scheduler", LRScheduler),
    ("metrics", Metrics),
    ("audio_encoder", AudioEncoderConfig),
    ("lora", Lora),
)


def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring} from the class source (the string right after each field)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def toml_value(value: object) -> str:
    """``value`` as a TOML literal (``true``, ``"delay"``, ``[1.0, 2.0]``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def default_of(f) -> object:
    """A dataclass field's default value."""
    return f.default if f.default is not MISSING else f.default_factory()


def keys_of(cls: type) -> list[tuple[str, str, str]]:
    """[(key, its default as TOML, its docstring)] of a section's dataclass, in field order."""
    docs = field_docs(cls)
    return [(f.name, toml_value(default_of(f)), docs.get(f.name, "")) for f in fields(cls)]
