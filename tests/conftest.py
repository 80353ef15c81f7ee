"""Shared fixtures: tiny random-init HF assets saved with save_pretrained (nothing downloaded),
and each test module's registrations kept to that module."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torchtitan_speechlm  # noqa: E402,F401,I001  (CPU device selection before torchtitan)

import pytest  # noqa: E402
import torchtitan.protocols.model_converter as _converters  # noqa: E402
import torchtitan.protocols.train_spec as _train_specs  # noqa: E402
from torchtitan_speechlm.codecs.base import CODECS  # noqa: E402
from torchtitan_speechlm.data.tasks import TASKS  # noqa: E402
from torchtitan_speechlm.judges.base import JUDGES  # noqa: E402
from torchtitan_speechlm.model.audio.encoders import AUDIO_ENCODERS  # noqa: E402
from torchtitan_speechlm.model.backbones import BACKBONES  # noqa: E402
from torchtitan_speechlm.model import families  # noqa: E402,F401,I001  (registered before they are saved)
from torchtitan_speechlm.model.patterns import PATTERNS  # noqa: E402
from torchtitan_speechlm.prepare.sources.base import SOURCES  # noqa: E402
from torchtitan_speechlm.trainer.spec import SPEECHLM_SPECS  # noqa: E402

from tests import file_order  # noqa: E402

REGISTRIES = (CODECS, TASKS, JUDGES, AUDIO_ENCODERS, BACKBONES, PATTERNS, SOURCES)

# A full run (make test, then make faults) held at most 0.7 GiB at once under the temporary
# folder (README, Development); 2 GiB leaves room. Below it, tests fail half-way with ENOSPC in
# whichever fixture comes next, which reads as a bug in that test.
MIN_FREE_GIB = float(os.environ.get("TORCHTITAN_TEST_MIN_FREE_GIB", "2"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--file-costs-out",
        default=None,
        help="add each test file's seconds (setup, call, teardown) to this JSON file's "
        "(tests/file_order.py; `make test-costs`)",
    )


def pytest_configure(config: pytest.Config) -> None:
    out = config.getoption("--file-costs-out")
    if out and not hasattr(config, "workerinput"):  # the xdist controller, or a plain run
        config.pluginmanager.register(file_order.CostRecorder(Path(out)), "file-costs")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest test files first (tests/file_order.py: the xdist workers end together)."""
    items[:] = file_order.longest_first(items, file_order.load_costs())


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to start on a nearly full disk, naming the folder and the fix."""
    folder = tempfile.gettempdir()
    free = shutil.disk_usage(folder).free / 2**30
    if free < MIN_FREE_GIB:
        pytest.exit(
            f"only {free:.1f} GiB free in {folder}, under the {MIN_FREE_GIB:g} GiB the tests "
            "ask for (their checkpoints, corpora and exports). Free some space, or point TMPDIR "
            "at a larger disk; TORCHTITAN_TEST_MIN_FREE_GIB=0 skips this check.",
            returncode=3,
        )


@pytest.fixture(autouse=True, scope="module")
def registrations_stay_in_their_module():
    """What a test module registers in this process (an extension module it imports: codecs,
    tasks, backbones, specs, ...) is removed when the module ends: runs of later modules forked
    from this process (tests/forked.py) see only the package's own registrations, as a fresh
    process does."""
    saved = [(reg, dict(reg._items)) for reg in REGISTRIES]
    specs = dict(_train_specs._extra_train_specs)
    converters = dict(_converters._registry_model_converter_cls)
    ours, modules = set(SPEECHLM_SPECS), set(sys.modules)
    yield
    for reg, items in saved:
        reg._items.clear()
        reg._items.update(items)
    _train_specs._extra_train_specs.clear()
    _train_specs._extra_train_specs.update(specs)
    _converters._registry_model_converter_cls.clear()
    _converters._registry_model_converter_cls.update(converters)
    SPEECHLM_SPECS.clear()
    SPEECHLM_SPECS.update(ours)
    for name in set(sys.modules) - modules:  # an extension imported again registers again
        if name.startswith("tests.") or name in ("mymod", "my_module"):
            sys.modules.pop(name, None)


@pytest.fixture(scope="session")
def espnet_assets(tmp_path_factory):
    """ESPnet's side of a tiny run, built once (tests/espnet_side/assets.py): a backbone folder
    holding its tokenizer, a tiny codec, a corpus in ESPnet's dataset format (24 items of
    varied lengths). Paths only: the modules under tests/ are imported again per test module."""
    from tests.espnet_side.assets import make_espnet_assets

    return make_espnet_assets(tmp_path_factory.mktemp("espnet_assets"))
