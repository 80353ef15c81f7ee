"""Every benchmark script still runs, so none rots unseen. Each `benchmarks/*.py` is imported,
the usage lines of its docstring parse with its own parser, and each one that measures
something runs as a user runs it (`python benchmarks/X.py ...`, its own process, from the
repository root) at its smallest setting (marker `bench_smoke`, run by `make faults`: about two
minutes of subprocesses that would push `make test` past its budget): a smoke test of the script, nothing timed or
compared, its results written under tmp_path and never to benchmarks/results/.

Not run: `bench_speaker_prompt.py` (a multi-voice espeak-ng corpus, a codec fit, training and
three judges: 98 s at its smallest, moved out of `make faults` for CI's 40 minutes; its flags and
pure functions are tested), `bench_preference.py` and `bench_preference_ceiling.py` (need a
`make demo` clone; the first's config and table, the second's best-of-k figures are tested),
`bench_demo_seeds.py` (the whole demo once per seed, about 8 minutes each; imported, its usage
line parses), `bench_audio_learning.py` (two trainings of the demo's model on its espeak-ng corpus,
minutes on 2 cores; imported and its usage lines parse), `bench_espnet_data.py` (an espeak-ng corpus, a codec fit, two trainings and two
`torchtitan eval`s: 56 s at its smallest, the second usage line of its docstring, run by hand; imported, its usage lines parse), `bench_learning.py` (an espeak-ng corpus, a codec fit, prepare, train, then `torchtitan
eval` with three judges per checkpoint: 96 s even at its smallest, `--train-sentences 8
--held-out 4 --steps 2 --eval-every 2 --eval-items 2 --hidden 32 --layers 1`, on 2 busy cores,
where it ran to the end; and it writes into benchmarks/results/): it is imported, its flags parse at a tiny setting, its TOML template
goes through torchtitan's ConfigManager, and its pure functions (`val_losses`, `summarise`,
`plot`) run on fabricated inputs shaped like `torchtitan eval`'s results (the keys it reads
are ones docs/generation.md documents). `run_all.py` (every benchmark at full size): every
script it lists exists and its flags parse. `gpu_check.sh`: `bash -n`, and every benchmark
command it runs (benchmarks/gpu_check.py's MICRO) parses; its dry run is
tests/integration/test_gpu_check.py. `bench_common.py` is the others' library (imported by them)."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests import forked
from tests.command_parsing import (
    BENCHMARKS,
    ROOT,
    Shown,
    bash_syntax_ok,
    check,
    load_script,
    parse,
    parse_train,
    script_parser,
)

RESULTS = BENCHMARKS / "results"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))

# each script's smallest setting (its docstring says so); {tmp}: the test's folder
SMOKE = {
    "bench_audio_encoder.py": "--shape tiny --repeats 1 --out {tmp}/a.json",
    "bench_attention.py": "--shapes 64x2 --repeats 1 --hidden 64 --layers 1 --out {tmp}/a.json",
    "bench_generate.py": "--model {model} --sentences 2 --repeats 1 --max-frames 8 "
    "--out {tmp}/a.json",
    "bench_decode.py": "--suite all --shape tiny --frames 4 --repeats 1 --out {tmp}/a.json",
    "bench_checkpoint_manifest.py": "--params 1000000 --tensors 8 --repeats 1 --out {tmp}/a.json",
    "bench_codec_decode.py": "--train-sentences 40 --kmeans-seconds 30 --codebook-size 16 "
    "--held-out 2 --iters 2 --repeats 1 --work {tmp}/work --out {tmp}/a.json",
    "bench_loader.py": "--dps 1,2 --steps 1 --micro-batches 2 --repeats 1 --config {toml} "
    "--out {tmp}/a.json",
    "bench_loss_memory.py": "--frames 64 --hidden 16 --dtypes float32 --results {tmp}/a.json",
    "bench_lora.py": "--shape tiny --repeats 1 --out {tmp}/a.json",
    "bench_memory_model.py": "--hidden 64 --layers 1 --seq-len 64 --docs 2 --modes none "
    "--out {tmp}/a.json",
    "codec_floor.py": "--fits 60:2:16:25 --oracle-rates 25 --train-per-speaker 2 "
    "--heldout-per-speaker 2 --work {tmp}/work --out {tmp}/a.json",
    "bench_expert_parallel.py": "--steps 2 --hidden 32 --experts 4 --seq-len 512 "
    "--work {tmp}/work --out {tmp}/a.json",
    "bench_pipeline.py": "--steps 2 --micro 2 --hidden 32 --layers 4 --seq-len 512 "
    "--schedules 1F1B --work {tmp}/work --out {tmp}/a.json",
    "bench_prepare.py": "--n 8 --held-out 2 --codecs kmeans --cache {tmp}/cache --out {tmp}/a.json",
    "bench_scale.py": "--scales 2000:4 --no-prepare --work {tmp}/work --out {tmp}/a.json",
    "bench_serve.py": "--frames 2 --requests 2 --cli-calls 1 --concurrency 1,2 --hidden 32 "
    "--layers 1 --slow-clients 1 --slow-seconds 2 --burst 4x2 --work {tmp}/work --out {tmp}/a.json",
    # --model: the module's tiny export (bench_serve.py's smoke run makes the model both share)
    "bench_serve_abuse.py": "--model {model} --frames 2 --clients 1 --seconds 2 "
    "--h1-hours 0.02 --h2-mb 1 --m1-sockets 4 --m2-concurrent 8 --m3-requests 4 "
    "--work {tmp}/work --out {tmp}/a.json",
    "bench_step_overhead.py": "--steps 2 --config {toml} --out {tmp}/a.json",
    "bench_vs_llama3.py": "--shape tiny --repeats 1 --configs speech --variants "
    "'speechlm hf-llama' --results-dir {tmp}",
    "bench_wave_store.py": "--n 4 --repeats 1 --work {tmp}/work --out {tmp}/a.json",
    "voice_table.py": "--voices us,us-m1 --sentences 2 --no-asr --out {tmp}/a.json",
}
NOT_RUN = (
    "bench_audio_learning.py",
    "bench_common.py",
    "bench_demo_seeds.py",
    "bench_espnet_data.py",
    "bench_learning.py",
    "bench_preference.py",
    "bench_preference_ceiling.py",
    "bench_speaker_prompt.py",
    "gpu_check.py",
    "run_all.py",
    "vllm_probe.py",
)  # gpu_check.py: its dry run is tests/integration/test_gpu_check.py; vllm_probe.py needs a
# vLLM venv (docs/vllm.md), its export is tests/unit/generation/test_vllm_export.py


def test_every_script_is_run_or_said_why_not():
    assert sorted([*SMOKE, *NOT_RUN]) == SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_imports_and_its_usage_lines_parse(name):
    module = load_script(BENCHMARKS / name)
    doc = module.__doc__ or ""
    if name == "bench_common.py":
        return
    usage = [" ".join(u.split()) for u in re.findall(r"python benchmarks/\w+\.py[^\n`]*", doc)]
    assert usage or name == "run_all.py", f"{name}: its docstring shows no command"
    for line in usage:
        check(Shown(name, line, inline=False))


@pytest.fixture(scope="module")
def tiny_toml(tmp_path_factory):
    """A tiny prepared dataset, backbone and config (the train tests' own) for the two
    benchmarks that read a training config."""
    from tests.helpers import make_tiny_run_assets, write_tiny_config

    root = tmp_path_factory.mktemp("bench_assets")
    assets = make_tiny_run_assets(root / "assets", n_items=16)
    return write_tiny_config(root / "tiny.toml", assets, root / "dump")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny trained export (tests/helpers.py ``tiny_export``) for the benchmark that reads a
    model folder."""
    from tests.helpers import tiny_export

    return tiny_export(tmp_path_factory.mktemp("bench_model"))["export"]


def _results_state() -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in RESULTS.iterdir() if p.is_file()}


@pytest.mark.slow
@pytest.mark.bench_smoke  # about 2 minutes: in `make faults`, beside the other slow launches
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_runs_at_its_smallest_setting(name, tmp_path, request):
    import shlex

    toml = request.getfixturevalue("tiny_toml") if "{toml}" in SMOKE[name] else ""
    model = request.getfixturevalue("tiny_model") if "{model}" in SMOKE[name] else ""
    argv = shlex.split(SMOKE[name].format(tmp=tmp_path, toml=toml, model=model))
    parse(script_parser(BENCHMARKS / name), argv)
    before = _results_state()
    # in a fork of this process: the script as `python benchmarks/X.py` runs it, without
    # importing torch, torchtitan and transformers again (~5 s a script on 2 cores); so do the
    # `torchtitan ...` and `python benchmarks/X.py ...` commands it runs with subprocess.run
    r = forked.python_script(f"benchmarks/{name}", argv, cwd=str(ROOT), timeout=300,
                             env={"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                             fork_commands=True)  # fmt: skip
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    written = sorted(p.name for p in tmp_path.glob("*.json"))
    assert written, f"{name} wrote no results under {tmp_path}"
    for f in written:
        json.loads((tmp_path / f).read_text())
    after = _results_state()
    changed = [f for f, t in before.items() if after.get(f) != t]
    assert not changed, f"{name} at its smallest setting rewrote benchmarks/results/{changed}"


def test_run_all_lists_existing_scripts_whose_flags_parse():
    run_all = load_script(BENCHMARKS / "run_all.py")
    assert run_all.BENCHES
    for script, *flags in run_all.BENCHES:
        assert (ROOT / script).is_file(), script
        parse(script_parser(ROOT / script), flags)
    listed = {os.path.basename(b[0]) for b in run_all.BENCHES}
    # `make bench` runs every benchmark
    assert listed == {
        *SMOKE,
        "bench_learning.py",
        "bench_espnet_data.py",
        "bench_speaker_prompt.py",
        "bench_preference.py",
        "bench_preference_ceiling.py",
    }


def test_gpu_check_script_is_valid_bash_and_its_commands_parse():
    import shlex

    bash_syntax_ok("benchmarks/gpu_check.sh")
    gpu_check = load_script(BENCHMARKS / "gpu_check.py")
    assert len(gpu_check.MICRO) >= 5, gpu_check.MICRO
    for name, argvs in gpu_check.MICRO.items():  # the GPU and the --dry-run command
        for argv in argvs:
            command = shlex.join(shlex.split(argv.format(o="/tmp/out", n=2)))
            check(Shown(f"gpu_check.py {name}", "python " + command, inline=False))


# ---- bench_learning.py without running it -----------------------------------------------------
def test_bench_learning_flags_toml_and_pure_functions(tmp_path):
    learning = load_script(BENCHMARKS / "bench_learning.py")
    tiny = "--train-sentences 8 --held-out 4 --steps 2 --eval-every 2 --eval-items 2 --tag _x"
    a = parse(script_parser(BENCHMARKS / "bench_learning.py"), [*tiny.split(), "--sweep"])
    assert (a.steps, a.eval_every, a.sweep) == (2, 2, True)

    # the TOML it trains with is a valid torchtitan job of our config module
    toml = tmp_path / "learning.toml"
    toml.write_text(
        learning.TOML.format(
            dump=tmp_path / "run",
            backbone=tmp_path / "backbone",
            steps=2,
            every=2,
            train=tmp_path / "train",
            lr=3e-3,
            heldout=tmp_path / "heldout",
            cfg_dropout=0.1,
            tts_share=a.tts_share,
            asr_share=round(1 - a.tts_share, 6),
        )  # fmt: skip
    )
    job = parse_train(["--job.config_file", str(toml)])
    assert (job.training.steps, job.validation.freq, job.checkpoint.interval) == (2, 2, 2)
    assert job.speechlm_data.valid == ["tts:heldout", "asr:heldout"]
    assert job.speechlm_data.train == ["tts:train:0.6", "asr:train:0.4"]

    # val_losses reads the validation losses of metrics.jsonl
    (tmp_path / "run").mkdir()
    rows = [
        {"step": 1, "loss_metrics/global_avg_loss": 5.0},
        {"step": 2, "val/tts_heldout/loss": 3.0, "val/asr_heldout/loss": 2.0},
    ]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert learning.val_losses(str(tmp_path / "run")) == {
        2: {"tts_heldout": 3.0, "asr_heldout": 2.0}
    }

    # summarise reads `torchtitan eval`'s results: only keys docs/generation.md documents
    read: set[str] = set()

    class Logged(dict):
        def __getitem__(self, k):
            read.add(k)
            return super().__getitem__(k)

        def get(self, k, default=None):
            read.add(k)
            return super().get(k, default)

    tts = Logged(
        wer=0.2, cer=0.1, floor={"wer": 0.03}, floor_recording={"wer": 0.02}, sim=0.9,
        sim_recording=0.8, duration_ratio={"median": 1.0, "mean": 1.0}, eos_rate=1.0,
        dnsmos=3.1, reference_dnsmos=3.2,
    )  # fmt: skip
    row = learning.summarise({"asr:heldout": Logged(wer=0.05), "tts:heldout": tts})
    assert row["tts_wer"] == 0.2 and row["floor_wer"] == 0.03 and row["asr_wer"] == 0.05
    assert row["duration_ratio_median"] == 1.0 and row["floor_recording_wer"] == 0.02
    schema = (ROOT / "docs" / "generation.md").read_text()
    schema = schema[schema.index("TTS set:") : schema.index("ASR item:")]
    undocumented = sorted(k for k in read if not re.search(rf"\b{k}\b", schema))
    assert not undocumented, f"bench_learning reads eval keys the docs do not list: {undocumented}"

    # plot draws the curves
    curve = [dict(step=s, val_loss={"tts_heldout": 3.0 / s, "asr_heldout": 2.0 / s}, **row)
             for s in (2, 4)]  # fmt: skip
    png = tmp_path / "learning.png"
    learning.plot(curve, {"recordings": 0.7, "resynthesised": 0.6}, str(png))
    assert png.stat().st_size > 10_000


# ---- bench_speaker_prompt.py and bench_preference.py without running them ----------------------
def test_bench_speaker_prompt_flags_and_pure_functions():
    sp = load_script(BENCHMARKS / "bench_speaker_prompt.py")
    tiny = "--steps 4 --train-per-speaker 2 --heldout-per-speaker 2 --eval-limit 4 --no-baseline"
    a = parse(script_parser(BENCHMARKS / "bench_speaker_prompt.py"), tiny.split())
    mix = sp.mixture("tts_prompt", a)
    weights = {e.split(":")[0]: float(e.split(":")[2]) for e in mix.split(",")}
    assert weights.pop("asr") == pytest.approx(1 - a.tts_share)
    assert sum(weights.values()) == pytest.approx(a.tts_share)
    assert sp.run_name("prompted", mix, a, True) != sp.run_name("prompted", mix + "x", a, True)
    row = sp.summary({"items": 4, "wer": 0.2, "floor": {"wer": 0.1},
                      "prompted": {"sim_prompt": 0.8, "sim_other": 0.5, "speakers": 3}})  # fmt: skip
    assert row["sim_margin"] == pytest.approx(0.3) and row["floor_wer"] == 0.1


def test_bench_preference_flags_config_and_table(tmp_path):
    """Its DPO config is a valid torchtitan job from the demo's step-400 with the demo's
    assets; its table reads `torchtitan eval`'s results (the keys a real eval writes)."""
    bp = load_script(BENCHMARKS / "bench_preference.py")
    smoke = "--demo . --prompts 8 --samples 2 --steps 2 --heldout 4 --eval-limit 4 --nll-weight 0.5"
    a = parse(script_parser(BENCHMARKS / "bench_preference.py"), smoke.split())
    assert a.prompt_set == "train"
    demo = tmp_path / "demo"
    (demo / "demo_work" / "backbone").mkdir(parents=True)
    config = bp.write_config(str(demo), str(tmp_path / "dpo.toml"), a)
    text = open(config).read()
    assert f'hf_assets_path = "{demo}/demo_work/backbone"' in text
    assert 'preference_loss = "dpo"' in text and "step-400" in text
    job = parse_train(["--job.config_file", config])
    assert (job.speechlm.preference_loss, job.optimizer.lr) == ("dpo", a.lr)
    assert job.speechlm.preference_nll_weight == 0.5
    tts = {"task": "tts", "wer": 0.3, "sim": 0.9, "dnsmos": 2.5, "eos_rate": 1.0,
           "duration_ratio": {"mean": 1.0, "median": 1.0},
           "self": {"asr_of_tts": {"wer": 0.2}},
           "per_item": [{"wer": w} for w in [0.0] * 20 + [1.0] * 20]}  # fmt: skip
    f = bp.figures({"tts:x": tts, "asr:x": {"task": "asr", "wer": 0.0}}, None)
    assert f["tts:x"]["wer_eval_judge_first_20"] == 0.0
    assert f["tts:x"]["wer_reward_judge"] == 0.2 and f["asr:x"] == {"asr_wer": 0.0}
    table = bp.table({"before": f, "after": f})
    assert table.count("tts:x | ") == 2 and "| 0.300 | 0.000 | 0.200 |" in table


def test_bench_preference_ceiling_best_of_k_against_a_direct_count():
    """Best of k by a ranker, scored by the eval judge, ties averaged (rounded to 4 places):
    checked against a count written out by hand on two items; mismatched draws are refused."""
    bc = load_script(BENCHMARKS / "bench_preference_ceiling.py")
    a = parse(
        script_parser(BENCHMARKS / "bench_preference_ceiling.py"), "--demo . --samples 4".split()
    )
    assert (a.samples, a.first) == (4, 20)
    # item u: eval WERs 0.5 0.0 1.0 0.25, own ASR 0.2 0.2 0.0 0.1, word loop 0.0 0.3 0.3 0.0
    # item v: eval WERs 0.0 0.4 0.4 0.0, own ASR 0.0 0.0 0.5 0.0, word loop 0.1 0.1 0.1 0.1
    ev = {"u": [0.5, 0.0, 1.0, 0.25], "v": [0.0, 0.4, 0.4, 0.0]}
    own = {"u": [0.2, 0.2, 0.0, 0.1], "v": [0.0, 0.0, 0.5, 0.0]}
    loop = {"u": [0.0, 0.3, 0.3, 0.0], "v": [0.1, 0.1, 0.1, 0.1]}
    grammar = {(i, s): {"wer": ev[i][s], "self_wer": own[i][s]} for i in ev for s in range(4)}
    looped = {(i, s): {"wer": loop[i][s], "self_wer": own[i][s]} for i in ev for s in range(4)}
    got = bc.ceilings(grammar, looped, 4, first=1)
    assert list(got) == ["first 1", "all 2"]
    full = got["all 2"]
    # k=1: sample 0 of each: (0.5 + 0.0) / 2
    assert all(full[r][1] == 0.25 for r in full)
    # oracle k=2: u min(0.5, 0.0) = 0, v min(0, 0.4) = 0; k=4: 0 and 0
    assert full["eval judge (oracle)"][2] == 0.0 and full["eval judge (oracle)"][4] == 0.0
    # own ASR k=2: u tie 0.2/0.2 -> (0.5 + 0.0) / 2 = 0.25; v tie -> (0 + 0.4) / 2 = 0.2
    assert full["own ASR"][2] == pytest.approx((0.25 + 0.2) / 2, abs=1e-4)
    # own ASR k=4: u sample 2 (1.0); v samples 0, 1, 3 tie -> (0 + 0.4 + 0) / 3
    assert full["own ASR"][4] == pytest.approx((1.0 + 0.4 / 3) / 2, abs=1e-4)
    # word loop k=4: u samples 0, 3 -> 0.375; v all tie -> 0.2
    assert full["word loop"][4] == pytest.approx((0.375 + 0.2) / 2, abs=1e-4)
    # both k=4: u sums 0.2 0.5 0.3 0.1 -> sample 3 (0.25); v 0.1 0.1 0.6 0.1 -> 0, 1, 3
    assert full["own ASR + word loop"][4] == pytest.approx((0.25 + 0.4 / 3) / 2, abs=1e-4)
    assert got["first 1"]["own ASR"][4] == 1.0  # item u alone
    assert "own ASR | 0.250 | 0.225" in bc.table({"ceilings": got})
    looped[("v", 2)] = {"wer": 0.1, "self_wer": 0.4}  # another sample: the draws differ
    with pytest.raises(SystemExit, match="differs"):
        bc.ceilings(grammar, looped, 4, first=1)
