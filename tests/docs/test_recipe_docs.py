"""The recipes say what they do (issue 37): docs/performance.md's table *The shipped recipes*
states, for every train_configs/*.toml, the activation checkpointing, local and global batch,
seq_len, compile, mixed precision, codec streams and parallelism degrees; each value is read
from the table and from the TOML (and, for the streams, from the `torchtitan prepare` command in
the recipe's header comment), so a change to either side alone fails here. docs/parallelism.md's
recipe list names every GPU recipe with the degrees it has, and docs/data.md's Mimi example
is the count the recipes use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomli

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "train_configs").glob("*.toml"))
CPU_RECIPES = ("speechlm_debug.toml", "speechlm_dpo.toml")  # the demo's, and DPO of its model
PRECISION = {"bf16": "bfloat16", "fp32": "float32"}


def _table() -> dict[str, dict[str, str]]:
    """The rows of performance.md's recipe table, keyed by recipe file name."""
    text = (ROOT / "docs" / "performance.md").read_text()
    section = text.split("### The shipped recipes", 1)[1]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[0] == "recipe", header
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(header, cells, strict=True))
    return rows


def _recipe(name: str) -> tuple[dict, str]:
    path = ROOT / "train_configs" / name
    text = path.read_text()
    return tomli.loads(text), text


def test_the_table_lists_every_recipe():
    assert sorted(_table()) == RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_table_row_equals_the_recipe(name):
    row, (cfg, text) = _table()[name], _recipe(name)
    training, par = cfg["training"], cfg.get("parallelism", {})

    ac = cfg.get("activation_checkpoint", {})
    m = re.fullmatch(r"`(\w+)`(?:, option (\w+))?", row["AC"])
    assert m, row["AC"]
    assert m.group(1) == ac.get("mode", "selective"), (name, "AC mode")
    if m.group(1) == "selective":
        assert m.group(2) == str(ac.get("selective_ac_option", "2")), (name, "AC option")

    assert int(row["local batch"]) == training["local_batch_size"], (name, "local batch")
    glob = training.get("global_batch_size", -1)
    if row["global batch"] == "local x ranks":
        assert glob == -1, (name, "global batch")
    else:
        assert int(row["global batch"]) == glob, (name, "global batch")
    assert int(row["seq_len"]) == training["seq_len"], (name, "seq_len")

    assert row["compile"] in ("on", "off")
    assert (row["compile"] == "on") == cfg.get("compile", {}).get("enable", False), (
        name,
        "compile",
    )

    param, reduce = (
        PRECISION[p.strip()] for p in row["mixed precision (param / reduce)"].split("/")
    )
    assert param == training.get("mixed_precision_param", "bfloat16"), (name, "param dtype")
    assert reduce == training.get("mixed_precision_reduce", "float32"), (name, "reduce dtype")

    # the streams of the data: the recipe's own prepare command (header comment) says how many
    comments = "\n".join(ln for ln in text.splitlines() if ln.startswith("#"))
    counts = set(re.findall(r"--(?:num-streams|codebooks) (\d+)", comments))
    assert counts == {row["streams"]}, (name, "streams", counts)

    degrees = dict(re.findall(r"(FSDP|TP|PP|EP) (-?\d+)", row["parallelism"]))
    keys = {"FSDP": "data_parallel_shard_degree", "TP": "tensor_parallel_degree",
            "PP": "pipeline_parallel_degree", "EP": "expert_parallel_degree"}  # fmt: skip
    for short, key in keys.items():
        want = par.get(key, -1 if short == "FSDP" else 1)
        assert int(degrees.get(short, 1)) == want, (name, key)
    assert par.get("data_parallel_replicate_degree", 1) == 1  # HSDP is not in the table


def test_gpu_recipes_carve_the_dev_set_their_valid_line_reads():
    for name in RECIPES:
        cfg, text = _recipe(name)
        names = {d.split("=", 1)[0] for d in cfg["speechlm_data"]["datasets"]}
        if "dev" in names and "FILL-IN" in text:
            assert re.search(r"--dev-fraction 0?\.\d+", text), name
            assert {"train", "dev"} <= names, name


def test_parallelism_doc_names_every_gpu_recipe_with_its_degrees():
    text = (ROOT / "docs" / "parallelism.md").read_text()
    section = text.split("## Recipes", 1)[1].split("\n## ", 1)[0]
    for name in RECIPES:
        if name in CPU_RECIPES:
            continue
        entry = next((e for e in section.split("\n- ") if name in e), None)
        assert entry is not None, f"docs/parallelism.md's Recipes list does not name {name}"
        par = _recipe(name)[0].get("parallelism", {})
        for short, key in (("TP", "tensor_parallel_degree"), ("EP", "expert_parallel_degree")):
            said = re.findall(rf"{short}=(\d+)", entry)
            assert [int(s) for s in said] == ([par[key]] if par.get(key, 1) > 1 else []), (
                name,
                key,
            )
        stages = re.findall(r"(\d+)-stage", entry)
        assert [int(s) for s in stages] == (
            [par["pipeline_parallel_degree"]] if par.get("pipeline_parallel_degree", 1) > 1 else []
        ), name


def test_data_doc_example_is_the_recipes_mimi_stream_count():
    flag = next(
        ln for ln in (ROOT / "docs" / "data.md").read_text().splitlines()
        if ln.startswith("| `--num-streams K`")
    )  # fmt: skip
    m = re.search(r"e\.g\. (\d+) of Mimi's 32", flag)
    assert m, flag
    gpu = [r for r in _table().values() if r["recipe"].strip("`") not in CPU_RECIPES]
    assert {r["streams"] for r in gpu} == {m.group(1)}
