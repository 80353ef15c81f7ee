"""Every supported parallelism / training technique, end to end with real processes on CPU/gloo.

Each case runs `torchtitan train` (our console script, torchtitan's own Trainer) for a few steps
and checks that it trains (exit 0, finite losses and grad norms, a later loss below the first) and,
where the technique must not change the maths, that it matches a reference run number for
number: same global batch, same data order, same deterministic init (SpeechLM.init_weights).

Reference runs are shared between cases (module-scoped cache), so the file starts 14 trainings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.helpers import make_tiny_run_assets, read_metrics, run_train, write_tiny_config

pytestmark = pytest.mark.slow

STEPS = 3
NO_CKPT_NO_VAL = ("--checkpoint.enable", "false", "--validation.enable", "false")
DDP = (
    "--parallelism.data_parallel_replicate_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "1",
)
HSDP = (
    "--parallelism.data_parallel_replicate_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "2",
)


@dataclass
class Run:
    steps: dict[int, dict]  # step -> metrics.jsonl row
    log: str
    dump: str

    def loss(self, step: int) -> float:
        return self.steps[step]["loss_metrics/global_avg_loss"]

    def grad_norm(self, step: int) -> float:
        return self.steps[step]["grad_norm"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="module")
def tied_assets(tmp_path_factory):
    return make_tiny_run_assets(tmp_path_factory.mktemp("tied_assets"), tie=True)


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    """train(assets, *flags, nproc=, local=) -> Run; identical requests are run once."""
    root = tmp_path_factory.mktemp("runs")
    cache: dict[tuple, Run] = {}

    def _train(
        assets: dict,
        *flags: str,
        nproc: int = 1,
        local: int = 4,
        steps: int = STEPS,
        checkpoint: bool = False,
    ) -> Run:
        key = (assets["backbone"], flags, nproc, local, steps, checkpoint)
        if key in cache:
            return cache[key]
        name = f"r{len(cache)}"
        dump = root / name
        cfg = write_tiny_config(root / f"{name}.toml", assets, dump)
        base = ("--validation.enable", "false") if checkpoint else NO_CKPT_NO_VAL
        with pytest.MonkeyPatch.context() as mp:
            # Every rank's log, not only rank 0's: a failure on another rank shows its cause.
            mp.setenv("LOG_RANK", ",".join(str(i) for i in range(nproc)))
            r = run_train(
                cfg,
                "--training.steps",
                str(steps),
                "--training.local_batch_size",
                str(local),
                *base,
                *flags,
                nproc=nproc,
                timeout=240,
            )
        log = r.stdout + r.stderr
        assert r.returncode == 0, f"{flags} nproc={nproc} failed:\n{log[-8000:]}"
        rows = {row["step"]: row for row in read_metrics(dump) if "grad_norm" in row}
        cache[key] = Run(rows, log, str(dump))
        return cache[key]

    return _train


def assert_trains(run: Run, steps: int = STEPS) -> None:
    assert sorted(run.steps) == list(range(1, steps + 1))
    for s in run.steps:
        assert math.isfinite(run.loss(s)) and math.isfinite(run.grad_norm(s)), run.steps[s]
    # each step has other samples (a harder batch can follow an easier one): it learns when a
    # later step's loss is below the first's
    later = [run.loss(s) for s in range(2, steps + 1)]
    assert min(later) < run.loss(1), [run.loss(s) for s in sorted(run.steps)]


def assert_same(a: Run, b: Run, steps, loss_abs=1e-5, grad_rel=1e-4, grad_abs=None) -> None:
    for s in steps:
        assert a.loss(s) == pytest.approx(b.loss(s), abs=loss_abs), f"loss at step {s}"
        tol = dict(abs=grad_abs) if grad_abs is not None else dict(rel=grad_rel)
        assert a.grad_norm(s) == pytest.approx(b.grad_norm(s), **tol), f"grad_norm at step {s}"


# --- a. DDP ---------------------------------------------------------------------------------
@pytest.mark.long  # FSDP's equivalence stays in make test; DDP is the second path
def test_ddp_matches_one_process(assets, train):
    """2 x 2 rows with DDP == 1 x 4 rows. grad_norm too: DDP must SUM gradients, not average
    them (torchtitan's loss is already divided by the global count; see parallelize.py)."""
    ref = train(assets, nproc=1, local=4)
    ddp = train(assets, *DDP, nproc=2, local=2)
    assert "Applied DDP to the model" in ddp.log
    assert "Applied FSDP" not in ddp.log and "Applied HSDP" not in ddp.log
    assert_trains(ddp)
    assert_same(ddp, ref, steps=range(1, STEPS + 1))


# --- b. HSDP --------------------------------------------------------------------------------
def test_hsdp_2x2_matches_one_process(assets, train):
    """4 ranks, replicate 2 x shard 2, 1 row x 2 micro-batches each == 1 process with 8 rows
    (also covers the replica all-reduce deferred to the last micro-batch, compat fix 6)."""
    ref = train(assets, nproc=1, local=8)
    hsdp = train(assets, *HSDP, "--training.global_batch_size", "8", nproc=4, local=1)
    assert "Applied HSDP to the SpeechLM" in hsdp.log
    assert "gradient accumulation steps 2" in hsdp.log
    assert_trains(hsdp)
    assert_same(hsdp, ref, steps=[1, 2], loss_abs=1e-5, grad_rel=1e-4)


# --- c. gradient accumulation ---------------------------------------------------------------
def test_gradient_accumulation_matches_one_big_batch(assets, train):
    """2 FSDP ranks x 2 rows x 2 microbatches == 1 process x 8 rows, loss AND grad norm."""
    ref = train(assets, nproc=1, local=8)
    acc = train(assets, "--training.global_batch_size", "8", nproc=2, local=2)
    assert "gradient accumulation steps 2" in acc.log
    assert "Applied FSDP to the SpeechLM" in acc.log
    assert_trains(acc)
    assert_same(acc, ref, steps=[1, 2], loss_abs=1e-5, grad_rel=1e-4)
    # DDP/HSDP + accumulation: tests/integration/test_metrics_distributed.py (compat fix 6).


# --- d. activation checkpointing ------------------------------------------------------------
# selective in 2 processes: make faults (test_selective_op_checkpointing_is_exact_in_process
# covers it in make test)
@pytest.mark.parametrize(
    "mode", ["full", pytest.param("selective", marks=pytest.mark.long)]
)  # selective: torchtitan's default "2"
def test_activation_checkpointing_is_exact(assets, train, mode):
    none = train(assets, "--activation_checkpoint.mode", "none", nproc=2, local=2)
    ac = train(assets, "--activation_checkpoint.mode", mode, nproc=2, local=2)
    assert f"Applied {mode} activation checkpointing to the model" in ac.log
    assert_trains(ac)
    assert_same(ac, none, steps=[1, 2], loss_abs=1e-5, grad_abs=1e-5)


def test_selective_op_checkpointing_is_exact_in_process(assets):
    """selective_ac_option=op (per-op policy with llama3's save list), through
    parallelize_speechlm in one process: same loss and gradients as no checkpointing.
    (In-process to keep the file short; the 2-process path is the same apply_ac call.)"""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    from tests.helpers import build_speechlm
    from torchtitan_speechlm.distributed.parallelize import parallelize_speechlm

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    grads, losses = [], []
    for mode in ("none", "selective"):
        model = build_speechlm(assets["backbone"], num_streams=4, z_loss_weight=1e-3)
        job = ConfigManager().parse_args(
            [
                "--job.custom_config_module",
                "torchtitan_speechlm.config",
                "--activation_checkpoint.mode",
                mode,
                "--activation_checkpoint.selective_ac_option",
                "op",
            ]
        )
        model = parallelize_speechlm(model, dims, job)
        wrapped = isinstance(model.backbone.layers[0], CheckpointWrapper)
        assert wrapped == (mode == "selective")
        layout = model.args.layout
        g = torch.Generator().manual_seed(0)
        ids = [
            torch.randint(*layout.stream_range(k), (2, 16, 2), generator=g)
            for k in range(layout.num_streams)
        ]
        inputs = torch.stack([i[..., 0] for i in ids], -1)
        targets = torch.stack([i[..., 1] for i in ids], -1)
        out = model(inputs, targets=targets, loss_weights=torch.ones(targets.shape))
        out.loss_sum.backward()
        losses.append(out.loss_sum.detach())
        grads.append(
            {
                n.replace("._checkpoint_wrapped_module", ""): p.grad
                for n, p in model.named_parameters()
            }
        )
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    assert grads[1].keys() == grads[0].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-6, atol=1e-7, msg=name)


# --- e. torch.compile -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",
        # inductor generates and builds C++ kernels on CPU: ~30-40 s for this model with a cold
        # cache (measured on 2 cores), a few seconds warm. Worth it: it is the production backend
        # (in `make faults`: 17 s of make test's 15 minutes; aot_eager proves the wiring there).
        pytest.param("inductor", marks=pytest.mark.long),
    ],
)
def test_compile_per_layer_matches_eager(assets, train, backend):
    eager = train(assets, nproc=1, local=4)
    comp = train(assets, "--compile.enable", "true", "--compile.backend", backend, nproc=1, local=4)
    assert f"Compiled each decoder layer with torch.compile (backend={backend})" in comp.log
    assert_trains(comp)
    assert_same(comp, eager, steps=[1, 2], loss_abs=1e-4, grad_rel=1e-3)


# --- f. tied embeddings ---------------------------------------------------------------------
def test_tied_embeddings_under_fsdp(tied_assets, train):
    """The shared embedding/output Parameter stays in FSDP's root group (parallelize.py)."""
    ref = train(tied_assets, nproc=1, local=4)
    fsdp = train(tied_assets, nproc=2, local=2)
    assert "embedding and head tied" in fsdp.log  # the model line of a tied model
    assert "Applied FSDP to the SpeechLM" in fsdp.log
    assert_trains(fsdp)
    assert_same(fsdp, ref, steps=[1])


# --- g. bf16 parameters ---------------------------------------------------------------------
def test_bf16_params_under_fsdp_track_fp32(assets, train):
    fp32 = train(assets, "--activation_checkpoint.mode", "none", nproc=2, local=2)
    bf16 = train(
        assets,
        "--activation_checkpoint.mode",
        "none",
        "--training.mixed_precision_param",
        "bfloat16",
        nproc=2,
        local=2,
    )
    assert_trains(bf16)
    for s in range(1, STEPS + 1):
        assert bf16.loss(s) == pytest.approx(fp32.loss(s), rel=5e-2)
    # bf16 compute really happened (not silently fp32): the numbers are not bit-identical.
    assert any(bf16.grad_norm(s) != fp32.grad_norm(s) for s in range(1, STEPS + 1))


# --- h. freezing ----------------------------------------------------------------------------
def _fresh_init_state(assets: dict, dump: str) -> dict[str, torch.Tensor]:
    """The weights a run starts from: same config, 1 process, on CPU (init is deterministic)."""
    from torchtitan.config import ConfigManager

    from torchtitan_speechlm.model.model import SpeechLM
    from torchtitan_speechlm.trainer.run import prepare_run

    cfg = write_tiny_config(f"{dump}.init.toml", assets, dump)
    job = ConfigManager().parse_args(
        ["--job.config_file", cfg, "--job.custom_config_module", "torchtitan_speechlm.config"]
    )
    args = prepare_run(job)[1]
    with torch.device("meta"):
        model = SpeechLM(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_freeze_prefix_keeps_parameters_at_init(assets, train):
    import torch.distributed.checkpoint as dcp

    run = train(assets, "--speechlm.freeze", "backbone.layers.0", nproc=2, local=2, checkpoint=True)
    assert "Froze 11 parameters under backbone.layers.0" in run.log
    assert_trains(run)
    ckpt = f"{run.dump}/checkpoint/step-{STEPS}"
    init = _fresh_init_state(assets, run.dump)
    saved = {k: torch.empty_like(v) for k, v in init.items()}
    dcp.load(saved, checkpoint_id=ckpt)  # no process group: DCP reads it as a single process

    frozen = [k for k in init if k.startswith("backbone.layers.0.")]
    trained = [k for k in init if not k.startswith("backbone.layers.0.")]
    assert len(frozen) == 11 and trained
    for k in frozen:
        assert torch.equal(saved[k], init[k]), f"frozen {k} changed"
    for k in trained:
        assert not torch.equal(saved[k], init[k]), f"trainable {k} did not change"
    # The optimizer never saw the frozen parameters.
    keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert not any(k.startswith("optimizer.state.backbone.layers.0.") for k in keys)
    assert any(k.startswith("optimizer.state.backbone.layers.1.") for k in keys)
