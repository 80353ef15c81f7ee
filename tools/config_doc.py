"""docs/config.md's key tables, generated from the config dataclasses' field docstrings (the
one place a key is documented). ``python tools/config_doc.py`` rewrites the
generated blocks of docs/config.md; a test fails when they drift."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
from dataclasses import MISSING, fields

from torchtitan_speechlm import config

SECTIONS = (
    ("speechlm", config.SpeechLM),
    ("speechlm_data", config.SpeechLMData),
    ("speechlm_faults", config.SpeechLMFaults),
    ("checkpoint", config.Checkpoint),
    ("audio_encoder", config.AudioEncoderConfig),
    ("lora", config.Lora),
)
BEGIN, END = "<!-- generated from {name} by tools/config_doc.py -->", "<!-- end generated -->"


def field_docs(cls) -> dict[str, str]:
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


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def table(cls) -> str:
    docs = field_docs(cls)
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in fields(cls):
        default = f.default if f.default is not MISSING else f.default_factory()
        meaning = docs.get(f.name, "").replace("|", "\\|")  # a pipe would end the cell
        rows.append(f"| `{f.name}` | `{toml_value(default)}` | {meaning} |")
    return "\n".join(rows)


def render(text: str) -> str:
    """``text`` with every generated block replaced by the current tables."""
    for name, cls in SECTIONS:
        begin = BEGIN.format(name=name)
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(END), re.S)
        if not pattern.search(text):
            raise ValueError(f"docs/config.md has no block {begin!r}")
        text = pattern.sub(lambda _m, b=begin, c=cls: f"{b}\n{table(c)}\n{END}", text)
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Rewrite docs/config.md's generated key tables.")
    p.add_argument("path", nargs="?", default="docs/config.md", help="the page to rewrite")
    return p


def main(argv: list[str] | None = None) -> int:
    path = build_parser().parse_args(argv).path
    with open(path) as f:
        old = f.read()
    new = render(old)
    if new != old:
        with open(path, "w") as f:
            f.write(new)
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
