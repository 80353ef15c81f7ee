"""What each workaround in utils/compat.py (fixes 1-8, 10-19, 21, 23) does, tried as torchtitan
is used.

These are the tests of the sufficiency check (patches/check_sufficiency.py, `make
patches-check`): with ``TORCHTITAN_SPEECHLM_WORKAROUNDS=off`` they pass on a torchtitan with
every patches/ diff applied and fail on stock torchtitan 0.2.2, and each one fails when the diff
of a fix it names (``FIXES``) is the one left out. With the workarounds on they pass on stock
torchtitan. They need no other condition, so the check can run them under all of these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import (
    make_step_dirs,
    make_tiny_run_assets,
    read_metrics,
    run_train,
    write_tiny_config,
)

pytestmark = pytest.mark.upstream

# test name -> the compat fixes (and patches/ diffs) it exercises: with that diff left out and
# the workarounds off, the test must fail
FIXES = {
    "test_one_process_trains_on_cpu_through_the_console_script": (1, 2, 15),
    "test_two_process_fsdp_on_gloo_matches_one_process": (3, 4, 5),
    "test_ddp_with_accumulation_matches_one_process": (6, 7),
    "test_purge_never_counts_a_half_written_checkpoint": (8,),
    "test_a_resave_removes_the_old_index_before_the_ranks_write": (8,),
    "test_a_pipeline_matches_one_process": (10,),
    "test_torchtitans_moe_routes_tokens_on_cpu": (11,),
    "test_expert_parallelism_matches_one_process": (12,),
    "test_a_cpu_run_logs_no_gpu_peak_flops_and_no_mfu": (13,),
    "test_the_model_arguments_are_one_line_at_info": (14,),
    "test_a_step_off_the_interval_is_saved_once_when_asked": (16,),
    "test_training_ends_on_a_barrier_of_the_ranks_not_a_sleep": (17,),
    "test_the_trainer_imports_hf_datasets_only_to_build_a_text_dataset": (18,),
    "test_attention_is_compiled_at_its_first_call_not_at_import": (19,),
    "test_the_launcher_parses_the_command_line_once": (21,),
    "test_a_cpu_run_flushes_denormals_in_every_thread": (23,),
}

STEPS = ("--training.steps", "2", "--checkpoint.enable", "false", "--validation.enable", "false")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("assets"), n_items=24)


@pytest.fixture(scope="module")
def train(tmp_path_factory, assets):
    """train(*flags, nproc=) -> {step: metrics row}; identical requests run once."""
    return trainer(tmp_path_factory.mktemp("runs"), assets)


@pytest.fixture(scope="module")
def train_llama(tmp_path_factory):
    """``train`` with a 4-layer Llama backbone (the native flavor: pipelines)."""
    root = tmp_path_factory.mktemp("llama")
    return trainer(
        root, make_tiny_run_assets(root / "assets", n_items=24, family="llama", num_layers=4)
    )


@pytest.fixture(scope="module")
def train_moe(tmp_path_factory):
    """``train`` with a Qwen3-MoE backbone (4 experts, top 2; the qwen3 flavor: experts)."""
    root = tmp_path_factory.mktemp("moe")
    return trainer(root, make_tiny_run_assets(root / "assets", n_items=24, family="qwen3_moe"))


def trainer(root, assets):
    cache: dict[tuple, dict[int, dict]] = {}
    logs: dict[tuple, str] = {}  # the run's console (rank 0's)

    def _train(*flags: str, nproc: int = 1) -> dict[int, dict]:
        key = (flags, nproc)
        if key not in cache:
            dump = root / f"r{len(cache)}"
            cfg = write_tiny_config(root / f"r{len(cache)}.toml", assets, dump)
            r = run_train(cfg, *STEPS, *flags, nproc=nproc, timeout=240)
            assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
            cache[key] = {row["step"]: row for row in read_metrics(dump) if "grad_norm" in row}
            logs[key] = r.stdout + r.stderr
        return cache[key]

    _train.log = lambda *flags, nproc=1: (_train(*flags, nproc=nproc), logs[(flags, nproc)])[1]
    return _train


def reference(train) -> dict[int, dict]:
    """One process, 4 rows a step."""
    return train("--training.local_batch_size", "4")


def assert_same_steps(got: dict[int, dict], ref: dict[int, dict]) -> None:
    assert sorted(got) == sorted(ref) == [1, 2]
    for step in (1, 2):
        for key in ("loss_metrics/global_avg_loss", "grad_norm"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-4), (step, key)


def test_one_process_trains_on_cpu_through_the_console_script(train):
    """Fix 1: torchtitan picks the CPU (not CUDA) without an accelerator; fix 2: its device
    memory monitor works on the CPU and reports the process's peak RSS; fix 15: torchtitan's
    Trainer builds the run from the spec our trainer hands it (its builders bound to the run),
    not the registered one. (A one-process run trains with the launcher's parse: fix 21.)"""
    rows = reference(train)
    assert sorted(rows) == [1, 2]
    assert all(row["memory/max_reserved(GiB)"] > 0 for row in rows.values())


def test_the_launcher_parses_the_command_line_once(tmp_path, assets, monkeypatch):
    """Fix 21: a one-process ``torchtitan train`` runs tyro once: our launcher's parse (which it
    checks before anything runs) is the config torchtitan's ``main`` trains with, not parsed a
    second time; the run trains as before."""
    import tyro

    calls = tmp_path / "tyro_calls"
    original = tyro.cli

    def counted(*args, **kwargs):
        with open(calls, "a") as f:  # the run is a fork of this process: a file counts
            f.write("call\n")
        return original(*args, **kwargs)

    monkeypatch.setattr(tyro, "cli", counted)
    cfg = write_tiny_config(tmp_path / "r.toml", assets, tmp_path / "run")
    r = run_train(str(cfg), *STEPS, timeout=240)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    steps = sorted(row["step"] for row in read_metrics(tmp_path / "run") if "grad_norm" in row)
    assert steps == [1, 2]
    assert calls.read_text().count("call") == 1


def test_a_cpu_run_logs_no_gpu_peak_flops_and_no_mfu(train):
    """Fix 13: a CPU has no peak FLOPS, so a CPU run neither runs ``lspci`` and warns about it
    nor falls back to an A100's peak, and shows and logs no MFU (its tflops stay)."""
    rows, log = reference(train), train.log("--training.local_batch_size", "4")
    for said in ("lspci", "Peak flops", "Peak FLOPS", "A100", "mfu"):
        assert said not in log, said
    assert all("mfu(%)" not in row and row["tflops"] > 0 for row in rows.values())
    assert "tflops: " in log


def test_the_model_arguments_are_one_line_at_info(train):
    """Fix 14: torchtitan's ``Building speechlm hf`` line is one line at INFO, not every model
    argument as indented JSON (the backbone's config.json, the vocabulary's reserved tokens)."""
    log = train.log("--training.local_batch_size", "4")
    building = [ln for ln in log.splitlines() if " - INFO - Building speechlm hf" in ln]
    assert len(building) == 1, building
    for dumped in ('"_enforced"', '"backbone_config"', "<|reserved_63|>"):
        assert dumped not in log, dumped


def test_a_cpu_run_flushes_denormals_in_every_thread(train):
    """Fix 23: a CPU run flushes denormal floats to zero in its thread and in torch's CPU
    threads (x86 computes them about 60x slower, and a long run meets more of them as it
    learns): the trainer's probe of the threads (``compat.denormals_flushed``) says so."""
    log = train.log("--training.local_batch_size", "4")
    assert " - INFO - CPU threads flush denormal floats to zero" in log, log[-3000:]


def test_two_process_fsdp_on_gloo_matches_one_process(train):
    """Fix 3: FSDP2's reduce-scatter runs on gloo (no PREMUL_SUM) and sums exactly; fix 4:
    torchtitan's process-group timeouts are set after step 1 on gloo (no device barrier); fix 5:
    each rank's torchtitan ``main`` parses the arguments the rank was started with (as torchrun
    starts ``torchtitan_speechlm.train ARGS``), not those of the process it was imported in."""
    fsdp = train("--training.local_batch_size", "2", nproc=2)
    assert_same_steps(fsdp, reference(train))


def test_training_ends_on_a_barrier_of_the_ranks_not_a_sleep(train):
    """Fix 17: torchtitan's ``train`` ends with every rank at a barrier, not with rank 0 alone
    sleeping 2 seconds (every run paid them, one process included): the 2-process run above
    completes, exactly as one process does, and neither says it sleeps."""
    for nproc in (2, 1):
        log = train.log("--training.local_batch_size", str(4 // nproc), nproc=nproc)
        assert "Training completed" in log
        assert "Sleeping 2 seconds" not in log, nproc


def test_ddp_with_accumulation_matches_one_process(train):
    """Fix 7: DDP sums the ranks' gradients (torchtitan divides the loss by the global count);
    fix 6: with 2 micro-batches a step, only the last backward all-reduces, so the first
    micro-batch is not counted twice. Losses and grad norms equal one process's."""
    ddp = train(
        "--parallelism.data_parallel_replicate_degree", "2",
        "--parallelism.data_parallel_shard_degree", "1",
        "--training.local_batch_size", "1", "--training.global_batch_size", "4",
        nproc=2,
    )  # fmt: skip
    assert_same_steps(ddp, reference(train))


@pytest.fixture
def rank0():
    """A one-process gloo group: torchtitan's purge runs on rank 0 of one."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_purge_never_counts_a_half_written_checkpoint(tmp_path, rank0):
    """Fix 8: with step-1, step-2 complete, step-3 killed mid-write and step-4 in flight,
    keep_latest_k = 2 deletes nothing (counting folders would delete step-2, the newest
    complete one); once step-5 and step-6 are complete, step-1, step-2 and the superseded
    partial step-3 and step-4 go."""
    import queue
    from types import SimpleNamespace

    from torchtitan.components.checkpoint import CheckpointManager

    def purged(k: int) -> list[str]:
        fake = SimpleNamespace(
            keep_latest_k=k, folder=str(folder), purge_queue=queue.Queue(),
            enable_ft_dataloader_checkpoints=False, ft_manager=None, purge_thread=object(),
        )  # fmt: skip
        CheckpointManager._purge_stale_checkpoints(fake)
        out = []
        while not fake.purge_queue.empty():
            out.append(os.path.basename(fake.purge_queue.get()))
        return sorted(out)

    folder = tmp_path / "checkpoint"
    make_step_dirs(folder, complete=[1, 2], partial=[3, 4])
    assert purged(k=2) == []
    make_step_dirs(folder, complete=[5, 6], partial=[])
    assert purged(k=2) == ["step-1", "step-2", "step-3", "step-4"]


def test_a_resave_removes_the_old_index_before_the_ranks_write(tmp_path, monkeypatch):
    """Fix 8: saving into a folder that already holds a complete checkpoint (a resave after
    resuming from an earlier step) removes its ``.metadata`` before DCP writes anything, so a
    save killed mid-write leaves a folder that is never loaded, not an old index over new
    data."""
    import torch
    from torchtitan.components import checkpoint as tt_ckpt

    target = tmp_path / "checkpoint" / "step-3"
    target.mkdir(parents=True)
    (target / ".metadata").write_bytes(b"an older save's index")
    seen = []

    def save(state_dict, checkpoint_id, **kwargs):  # DCP's save, as the manager calls it
        seen.append(os.path.exists(os.path.join(checkpoint_id, ".metadata")))

    monkeypatch.setattr(tt_ckpt.dcp, "save", save)
    tt_ckpt.CheckpointManager.dcp_save(
        None, {"w": torch.zeros(2)}, str(target), tt_ckpt.AsyncMode.DISABLED
    )
    assert seen == [False]


def test_a_step_off_the_interval_is_saved_once_when_asked():
    """Fix 16: a run asked to stop (SAVE_AND_STOP) saves its step in full off the interval,
    and not again a step the loop's own save wrote (on the interval, or the last step); the
    manager's interval is as before afterwards. The manager's writing is stubbed: what is
    checked is which steps it is asked to write, and as full (not last-step) saves."""
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

    from torchtitan_speechlm.utils.compat import save_checkpoint_now

    manager = object.__new__(CheckpointManager)
    saved = []
    for key, value in dict(
        enable=True, load_only=False, enable_first_step_checkpoint=False, interval=10,
        enable_ft_dataloader_checkpoints=False, ft_manager=None, async_mode=AsyncMode.DISABLED, stager=None,
        _create_checkpoint_id=lambda step, folder="": f"step-{step}",
        _async_wait=lambda: None, _flattened_model_states_sd=lambda: {"full": True},
        _purge_stale_checkpoints=lambda: None,
        _save_last_step=lambda step: saved.append(("last", step)),
        dcp_save=lambda states, checkpoint_id, **kw: saved.append((checkpoint_id, states)),
    ).items():  # fmt: skip
        setattr(manager, key, value)
    save_checkpoint_now(manager, 3, last_step=False)
    save_checkpoint_now(manager, 10, last_step=False)  # the loop saved it (interval)
    save_checkpoint_now(manager, 12, last_step=True)  # the loop saved it (last step)
    assert saved == [("step-3", {"full": True})]
    assert manager.interval == 10


def test_a_pipeline_matches_one_process(train_llama):
    """Fix 10: a 2-stage pipeline (1F1B, 2 microbatches) backpropagates the loss divided by the
    global loss frames before the schedule's backward, as one process does: the same grad norm
    (torchtitan 0.2.2's is global_valid_tokens times larger) and so the same losses."""
    native = ("--model.flavor", "native", "--training.local_batch_size", "4")
    ref = train_llama(*native)
    got = train_llama(
        *native,
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_parallel_microbatch_size", "2",
        nproc=2,
    )  # fmt: skip
    assert_same_steps(got, ref)


def test_torchtitans_moe_routes_tokens_on_cpu():
    """Fix 11: torchtitan's MoE layer (token-choice router, for-loop experts) runs on a CPU,
    its token counts integers that sum to tokens x top_k, its output each token's top-k
    experts' SwiGLU outputs weighted by the router's scores."""
    import torch
    import torch.nn.functional as F
    from torchtitan.models.moe import MoE, MoEArgs

    torch.manual_seed(0)
    args = MoEArgs(
        num_experts=4,
        num_shared_experts=0,
        score_func="softmax",
        top_k=2,
        use_grouped_mm=False,
        load_balance_coeff=None,
        score_before_experts=False,
    )
    moe = MoE(args, dim=8, hidden_dim=16)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device("cpu"))
        x = torch.randn(2, 5, 8)
        out = moe(x)
        scores, chosen, counts = moe.router(x.view(-1, 8))
    assert moe.tokens_per_expert.sum().item() == 2 * 5 * 2
    assert not counts.is_floating_point() and counts.sum().item() == 20
    e = moe.experts
    want = torch.zeros(10, 8)
    for t in range(10):
        for k in range(2):
            i, h = chosen[t, k], x.view(-1, 8)[t]
            y = (F.silu(e.w1[i] @ h) * (e.w3[i] @ h)) @ e.w2[i].T
            want[t] += scores[t, k] * y
    torch.testing.assert_close(out.view(-1, 8), want, atol=1e-5, rtol=1e-5)


def test_expert_parallelism_matches_one_process(train_moe):
    """Fix 12: expert parallelism's token permutation runs on CPU ranks (torchtitan's CPU
    implementation, not its Triton kernel): EP=2 on 2 processes logs one process's losses and
    grad norms with the same micro-batches (2 of 2 rows: the load-balance loss is a function of
    each micro-batch's routing)."""
    moe = ("--model.flavor", "qwen3", "--speechlm.load_balance_weight", "0.01",
           "--training.local_batch_size", "2", "--training.global_batch_size", "4")  # fmt: skip
    ref = train_moe(*moe)
    got = train_moe(*moe, "--parallelism.expert_parallel_degree", "2", nproc=2)
    assert_same_steps(got, ref)


# One fresh process for fixes 18 and 19 (this one imported datasets and inductor long ago):
# what importing the training side loads, then torchtitan's text dataloader and attention used.
FRESH_TRAINER_PROBE = """
import json, sys
import torchtitan_speechlm.commands.train  # what a training rank imports
import torchtitan.train
import torch

out = {"datasets": "datasets" in sys.modules, "inductor": "torch._inductor.compile_fx" in sys.modules}
from torchtitan.config import JobConfig
from torchtitan.protocols.train_spec import get_train_spec


class Tok:
    def encode(self, text, add_bos, add_eos):
        return [1, *(ord(c) % 50 for c in text), 2]


cfg = JobConfig()
cfg.training.dataset, cfg.training.dataset_path = "c4_test", sys.argv[1]
cfg.training.local_batch_size, cfg.training.seq_len = 2, 8
build = get_train_spec("llama3").build_dataloader_fn
inputs, labels = next(iter(build(dp_world_size=1, dp_rank=0, tokenizer=Tok(), job_config=cfg)))
out["text"] = [inputs["input"].tolist(), labels.tolist()]
if not out["inductor"]:  # else the calls below would compile for real
    from torchtitan.models import attention

    calls = []

    def compile_recorder(fn=None, **options):  # stands for torch.compile from here on
        calls.append([fn.__name__, options])
        return lambda *args, **kwargs: f"compiled {fn.__name__} called with {len(args)} tensors"

    torch.compile = compile_recorder
    x = torch.zeros(1, 2, 4, 8)
    flex = [attention.FlexAttentionWrapper()(x, x, x) for _ in range(2)]
    meta = attention.VarlenMetadata(torch.tensor([0, 4]), torch.tensor([0, 4]), 4, 4)
    varlen = attention.VarlenAttentionWrapper()(x, x, x, meta)
    mask = attention.create_attention_mask(lambda b, h, q, kv: q >= kv, 1, None, 4, 4)
    out["attention"] = [calls, flex, varlen, mask]
print(json.dumps(out))
"""
TEXTS = [f"line {i} of a small local text set" for i in range(6)]


@pytest.fixture(scope="module")
def fresh_trainer(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fresh_trainer")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in TEXTS)
    )
    env = dict(os.environ, HF_HOME=str(root / "hf"), HF_DATASETS_OFFLINE="1")
    r = subprocess.run(
        [sys.executable, "-c", FRESH_TRAINER_PROBE, str(root / "data")],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_trainer_imports_hf_datasets_only_to_build_a_text_dataset(fresh_trainer):
    """Fix 18: a process that imports the training side (ours and torchtitan's trainer) has not
    imported Hugging Face ``datasets``; torchtitan's own llama3 text dataloader still loads a
    local c4-style set through it and yields the tokens computed here."""
    assert not fresh_trainer["datasets"], "datasets was imported with the trainer"
    inputs, labels = fresh_trainer["text"]
    stream = [t for text in TEXTS for t in (1, *(ord(c) % 50 for c in text), 2)]
    assert inputs == [stream[0:8], stream[9:17]]  # each row takes seq_len + 1 tokens
    assert labels == [stream[1:9], stream[10:18]]


def test_attention_is_compiled_at_its_first_call_not_at_import(fresh_trainer):
    """Fix 19: a CPU process that imports the training side has not imported inductor's
    compiler; torchtitan's flex attention, varlen attention and block-mask builder each call
    ``torch.compile`` with torchtitan's own arguments at their first use, once (a recorder
    stands for it, so nothing compiles here)."""
    assert not fresh_trainer["inductor"], "inductor was imported with the trainer"
    calls, flex, varlen, mask = fresh_trainer["attention"]
    flex_options = {"wrap_inductor_compiled_regions": True, "max_autotune": True,
                    "coordinate_descent_tuning": True, "triton.cudagraphs": False}  # fmt: skip
    assert calls == [
        ["flex_attention", {"options": flex_options}],
        ["varlen_attn", {"mode": "max-autotune-no-cudagraphs"}],
        ["create_block_mask", {}],
    ]
    assert flex == ["compiled flex_attention called with 3 tensors"] * 2
    assert varlen == "compiled varlen_attn called with 7 tensors"
    assert mask == "compiled create_block_mask called with 5 tensors"
