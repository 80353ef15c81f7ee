"""The Qwen3-30B-A3B recipe (train_configs/qwen3_30b_a3b_tts_asr.toml) runs as shipped at tiny
shapes: only its FILL-IN paths replaced (tests/recipes.py) by a backbone with the real
Qwen3-30B-A3B config.json keys and tiny widths (tests/real_checkpoints.py: 2 layers, hidden 64,
8 experts top 2) and by train/dev sets made with `prepare --dev-fraction` (as its comment says),
sizes cut by command-line overrides, EP 2 on 2 gloo processes (the recipe's EP 8 needs 8 ranks).
Everything else stays as shipped: the qwen3 flavor, FSDP over all ranks, full AC, bf16 mixed
precision with fp32 reduction, fused AdamW, the load-balance weight, validation on dev, and
compile off (the recipe's own setting, explained there; nothing is overridden for the CPU)."""

import json

import numpy as np
import pytest
import soundfile as sf

from tests.helpers import read_metrics, run_train, tiny_model_assets
from tests.real_checkpoints import save_real_backbone
from tests.recipes import cut_overrides, filled_recipe
from torchtitan_speechlm.demo.assets import load_sentences
from torchtitan_speechlm.prepare.pipeline import prepare_dataset

pytestmark = [pytest.mark.slow, pytest.mark.long]  # in make faults (make test budget)
RECIPE = "qwen3_30b_a3b_tts_asr.toml"


def test_moe_recipe_trains_with_expert_parallelism_at_tiny_shapes(tmp_path):
    assets = tiny_model_assets(tmp_path / "assets")  # tokenizer and codec (its backbone unused)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(assets["tokenizer"]))
    backbone = tmp_path / "Qwen3-30B-A3B-Base"
    shipped = save_real_backbone(backbone, "qwen3_30b_a3b", num_layers=2, shrink=True,
                                 vocab_size=vocab)  # fmt: skip
    assert shipped["model_type"] == "qwen3_moe" and shipped["torch_dtype"] == "bfloat16"
    assert (shipped["num_experts"], shipped["num_experts_per_tok"]) == (8, 2)

    rng = np.random.default_rng(0)
    manifest = tmp_path / "manifest.jsonl"
    with open(manifest, "w") as f:
        for i, text in enumerate(load_sentences()[:32]):
            t = np.arange(int(16000 * (0.3 + 0.02 * len(text.split())))) / 16000
            wav = 0.3 * np.sin(2 * np.pi * (150 + 20 * (i % 7)) * t)
            wav = wav + 0.01 * rng.standard_normal(len(t))
            sf.write(tmp_path / f"u{i}.wav", wav.astype(np.float32), 16000)
            line = {"id": f"u{i}", "audio": f"u{i}.wav", "text": text, "speaker": f"s{i % 8}"}
            f.write(json.dumps(line) + "\n")
    prepared = tmp_path / "prepared"
    prepare_dataset(str(manifest), assets["codec"], assets["tokenizer"], str(prepared),
                    progress=False, dev_fraction=0.25)  # fmt: skip

    dump = tmp_path / "run"
    cfg = filled_recipe(RECIPE, tmp_path / RECIPE, str(backbone),
                        {"train": str(prepared / "train"), "dev": str(prepared / "dev")},
                        str(dump))  # fmt: skip
    settings = [ln for ln in open(cfg).read().splitlines() if not ln.lstrip().startswith("#")]
    assert not any("FILL-IN" in ln for ln in settings) and 'flavor = "qwen3"' in settings
    r = run_train(
        cfg,
        *cut_overrides(2, steps=4),
        "--parallelism.expert_parallel_degree", "2",  # the recipe's 8 needs 8 ranks
        nproc=2,
        timeout=900,
    )  # fmt: skip
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "Applied expert parallelism (EP=2" in log
    metrics = read_metrics(dump)
    steps = [m for m in metrics if "loss_metrics/global_avg_loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(np.isfinite(m["loss_metrics/global_avg_loss"]) for m in steps)
    logged = set().union(*metrics)
    assert {"train/load_balance_loss", "train/moe/expert7_share"} <= logged, sorted(logged)
    for name in ("tts_dev", "asr_dev"):
        assert any(f"val/{name}/loss" in m for m in metrics), name
    assert (dump / "checkpoint" / "step-4").is_dir()
