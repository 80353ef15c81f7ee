"""docs/config.md's key tables, generated from the config dataclasses' field docstrings (the
one place a key is documented). ``python tools/config_doc.py`` rewrites the
generated blocks of docs/config.md; a test fails when they drift."""

from __future__ import annotations

import argparse
import re
import sys

from torchtitan_speechlm.config.field_docs import SECTIONS, keys_of

BEGIN, END = "<!-- generated from {name} by tools/config_doc.py -->", "<!-- end generated -->"


def table(cls) -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for name, default, meaning in keys_of(cls):
        meaning = meaning.replace("|", "\\|")  # a pipe would end the cell
        rows.append(f"| `{name}` | `{default}` | {meaning} |")
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
