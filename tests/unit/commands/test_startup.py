"""Start-up: `torchtitan --help`, each argparse command's `--help` and a mistyped flag answer
without importing torch (cli.py parses before it imports a command), and the package's import
hook still installs the torchtitan fixes before torchtitan's modules run (utils/import_hooks.py).
Each case in a fresh interpreter, since this test process has torch loaded long ago."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from torchtitan_speechlm import cli

PROBE = """
import sys
from torchtitan_speechlm import cli
try:
    code = cli.main({argv!r})
except SystemExit as e:
    code = e.code
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "torchtitan.")))
print("RESULT", code, len(loaded), loaded[:5])
"""


def _probe(argv: list[str]) -> tuple[int, int, str]:
    r = subprocess.run(
        [sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=60
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert line, r.stdout[-2000:] + r.stderr[-2000:]
    _, code, count, names = line[0].split(" ", 3)
    return int(code), int(count), r.stdout + r.stderr


@pytest.mark.parametrize("command", [[], *([c] for c in cli.PARSERS)])
def test_help_imports_no_torch(command):
    code, loaded, out = _probe([*command, "--help"])
    assert code == 0
    assert loaded == 0, out
    assert "usage: torchtitan" in out


@pytest.mark.parametrize("command", list(cli.PARSERS))
def test_a_mistyped_flag_is_refused_before_torch_loads(command):
    code, loaded, out = _probe([command, "--no-such-flag"])
    assert code == 2
    assert loaded == 0, out
    assert "unrecognized arguments: --no-such-flag" in out or "required" in out


def test_an_unknown_command_is_refused_before_torch_loads():
    code, loaded, out = _probe(["synthesise"])
    assert (code, loaded) == (2, 0)
    assert "unknown command 'synthesise'" in out


def fresh_python(code: str) -> str:
    """``code``'s standard output in a fresh interpreter (which must succeed)."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_torchtitan_imported_after_the_package_gets_the_fixes_first():
    """The hook runs fix 1 before torchtitan's modules cache their device, fixes 2, 4 and 8
    after; a module of ours that imports torchtitan first (the native backbone) is unaffected."""
    code = (
        "import sys, torchtitan_speechlm\n"
        "assert 'torch' not in sys.modules\n"
        "import torchtitan_speechlm.model.backbones.native\n"
        "import torch, torchtitan.tools.utils as tu, torchtitan.distributed.utils as du\n"
        "from torchtitan.components.checkpoint import CheckpointManager\n"
        "gpu = torch.cuda.is_available()\n"
        "print(gpu, tu.device_type, getattr(du, '_speechlm_cpu_patched', gpu), "
        "CheckpointManager._speechlm_safe)\n"
    )
    gpu, device, cpu_patched, safe = fresh_python(code).split()[-4:]
    assert device == ("cuda" if gpu == "True" else "cpu")  # an accelerator keeps its own
    assert (cpu_patched, safe) == ("True", "True")


def test_prepare_loads_no_backbone_torchtitan_or_hf_datasets():
    """`torchtitan prepare`'s modules (its command, pipeline, workers, sources and the task
    templates it reads) load the light parts of the model (vocabulary, patterns, codec
    identity) without a backbone family, torchtitan or Hugging Face datasets (model/families.py,
    utils/upstream.py KNOWN_WITHOUT_IMPORT): about 3 s less of its start. The training side
    still registers every built-in family."""
    code = (
        "import sys\n"
        "import torchtitan_speechlm.commands.prepare, torchtitan_speechlm.prepare.pipeline\n"
        "import torchtitan_speechlm.prepare.worker, torchtitan_speechlm.data.tasks\n"
        "heavy = sorted(m for m in sys.modules if m.startswith(('torchtitan.', 'datasets', "
        "'torchtitan_speechlm.model.backbones', 'torchtitan_speechlm.model.audio')))\n"
        "print('PREPARE', heavy[:5])\n"
        "from torchtitan_speechlm.model import args\n"
        "from torchtitan_speechlm.model.audio.encoders import AUDIO_ENCODERS\n"
        "from torchtitan_speechlm.model.backbones import BACKBONES\n"
        "print('TRAINING', sorted(BACKBONES.names()), len(AUDIO_ENCODERS.names()) > 0)\n"
    )
    lines = dict(line.split(" ", 1) for line in fresh_python(code).splitlines() if " " in line)
    assert lines["PREPARE"] == "[]", lines
    assert lines["TRAINING"] == "['hf', 'native', 'qwen3'] True", lines


def test_train_help_is_a_page_of_our_keys_before_torch():
    """`torchtitan train --help`: every key of our sections in the docs' spelling, the
    torchtitan keys it names exist upstream, a page (not tyro's 1,200 lines), before torch."""
    from torchtitan_speechlm.commands.train_help import TORCHTITAN_KEYS
    from torchtitan_speechlm.config.field_docs import SECTIONS
    from torchtitan_speechlm.config.override_check import config_keys
    from torchtitan_speechlm.utils import upstream

    code, loaded, out = _probe(["train", "--help"])
    assert (code, loaded) == (0, 0), out
    assert out.startswith("usage: torchtitan train --job.config_file FILE.toml")
    for name, cls in SECTIONS:
        for key in cls.__dataclass_fields__:
            assert f"  --{name}.{key} (default " in out, key
    upstream_keys = config_keys(upstream.job_config_class("torchtitan_speechlm.config"))
    for key, _ in TORCHTITAN_KEYS:
        assert key in upstream_keys and f"  --{key}\n" in out, key
    assert len(out.splitlines()) < 400 and "--help-all" in out


def test_train_help_all_is_tyros_list_with_our_sections():
    code, loaded, out = _probe(["train", "--help-all"])
    assert code == 0 and loaded > 0, out
    assert "--training.steps" in out and "--speechlm.pattern" in out and "--lora.rank" in out


def test_wandb_starts_without_its_launch_agent_and_still_applies_staged_inputs(tmp_path):
    """Fix 20 (utils/compat.py): a ``wandb.init`` (offline, as torchtitan's logger makes it)
    does not import wandb's launch package (about 1.6 s), where nothing imported the module that
    stages launch inputs; where something did, the staged inputs are applied to the run as
    wandb applies them."""
    code = (
        "import sys, wandb\n"
        "from torchtitan_speechlm.utils import compat\n"
        "compat.start_wandb_without_its_launch_agent()\n"
        "compat.start_wandb_without_its_launch_agent()  # twice: wrapped once\n"
        f"kw = dict(mode='offline', dir={str(tmp_path)!r}, project='p')\n"
        "wandb.init(**kw).finish()\n"
        "print('LAUNCH', 'wandb.sdk.launch' in sys.modules)\n"
        "from wandb.sdk.launch.inputs import internal\n"
        "applied = []\n"
        "internal.StagedLaunchInputs.apply = lambda self, run: applied.append(run.id)\n"
        "run = wandb.init(**kw)\n"
        "run.finish()\n"
        "print('APPLIED', applied == [run.id])\n"
    )
    out = fresh_python(code)
    lines = dict(
        line.split(" ", 1) for line in out.splitlines() if line.startswith(("LAUNCH", "APPLIED"))
    )
    assert lines == {"LAUNCH": "False", "APPLIED": "True"}, out


@pytest.mark.parametrize("first", ["wandb", "torchtitan"])
def test_a_users_own_wandb_run_starts_without_its_launch_agent(tmp_path, first):
    """Fix 20 is installed with torchtitan's fixes, so the run a user's script starts itself
    (ESPnet's ``bin/train.py`` calls ``wandb.init`` before it builds ``TitanTrainer``) skips the
    launch agent too, whichever of wandb and torchtitan the script imported first."""
    imports = ["import wandb", "import torchtitan_speechlm, torchtitan"]
    code = "\n".join(
        [*(imports if first == "wandb" else imports[::-1]),
         "import sys",
         f"wandb.init(mode='offline', dir={str(tmp_path)!r}, project='p').finish()",
         "print('LAUNCH', 'wandb.sdk.launch' in sys.modules)"]
    )  # fmt: skip
    out = fresh_python(code)
    assert "LAUNCH False" in out.splitlines(), out


def test_transformers_model_code_loads_without_scipys_optimisers_until_they_are_used():
    """Fix 22 (utils/compat.py): importing transformers' model code after the package leaves
    ``scipy.optimize``'s code unrun (transformers' detection losses import one function of it);
    that function, called through the name they imported, loads it and gives scipy's optimal
    assignment (checked against every permutation here); `import *` gets all of its names."""
    code = (
        "import sys, numpy as np\n"
        "import torchtitan_speechlm, transformers.modeling_utils\n"
        "print('LOADED', 'scipy.optimize._optimize' in sys.modules)\n"
        "from transformers.loss import loss_for_object_detection as od\n"
        "cost = np.array([[4.0, 1, 3], [2, 0, 5], [3, 2, 2]])\n"
        "rows, cols = od.linear_sum_assignment(cost)\n"
        "print('COLS', *cols.tolist())\n"
        "print('RAN', 'scipy.optimize._optimize' in sys.modules)\n"
        "names = {}\n"
        "exec('from scipy.optimize import *', names)\n"
        "print('STAR', 'minimize' in names and 'linprog' in names)\n"
    )
    out = fresh_python(code)
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.split(" ")[0].isupper())
    cost = [[4.0, 1, 3], [2, 0, 5], [3, 2, 2]]
    best = min(itertools.permutations(range(3)), key=lambda p: sum(cost[i][p[i]] for i in range(3)))
    assert lines["LOADED"] == "False", out
    assert lines["COLS"] == " ".join(map(str, best)), out
    assert lines["RAN"] == "True" and lines["STAR"] == "True", out


def test_prepare_answers_help_and_a_mistyped_flag_before_torch_loads():
    """`prepare` parses with its own sources' flags before its implementation is imported: its
    help (the same page the full path prints) and a mistyped flag load no torch."""
    code, loaded, out = _probe(["prepare", "--help"])
    assert code == 0 and loaded == 0, out
    assert "--manifest" in out and "--lhotse" in out and "--import" in out
    code, loaded, out = _probe(["prepare", "--no-such-flag"])
    assert code == 2 and loaded == 0, out
    assert "unrecognized arguments: --no-such-flag" in out


def test_prepare_with_import_registers_the_modules_sources_before_it_parses(tmp_path):
    """With `--import` (or an abbreviation argparse takes for it: `--imp`, `--i`), the
    module's source is a flag of the parser: its help lists it, as it did when `prepare` always
    imported first."""
    (tmp_path / "my_source_mod.py").write_text(
        "from torchtitan_speechlm.prepare.sources.base import PrepareSource, register_source\n"
        "register_source(PrepareSource('my_lines', '--my-lines', 'FILE', 'my own lines', print))\n"
    )
    for spelling in ("--import", "--imp", "--i"):
        r = subprocess.run(
            [sys.executable, "-m", "torchtitan_speechlm.cli", "prepare", spelling,
             "my_source_mod", "--help"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        assert "--my-lines" in r.stdout, r.stdout
