"""The progress lines of the steps a user waits on: a line at least every `every` seconds while
a step blocks (utils/progress.py's heartbeat, timed here on a real thread), none with
`--no-progress`; and `make`'s install wrapper (tools/install_progress.py) on a real process that
prints pip's kinds of lines with pauses: the noise dropped, a line at least every 5 s, pip's exit
status kept."""

from __future__ import annotations

import inspect
import io
import re
import sys
import textwrap
import time

from tools import install_progress
from torchtitan_speechlm.utils.progress import Progress


class Stamped(io.StringIO):
    """The lines written, each with the time it was written."""

    def __init__(self) -> None:
        super().__init__()
        self.stamped: list[tuple[float, str]] = []

    def write(self, s: str) -> int:
        for line in s.splitlines():
            if line:
                self.stamped.append((time.monotonic(), line))
        return len(s)


def gaps(stamps: list[float], start: float, end: float) -> list[float]:
    times = [start, *stamps, end]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_a_blocking_step_says_its_status_at_least_every_period():
    out = Stamped()
    start = time.monotonic()
    with Progress("torchtitan eval", every=0.4, stream=out) as p:
        p.say("loading the judges")
        time.sleep(1.3)  # a call that blocks: the heartbeat speaks for it
        p.status = "items 1-6 of 6: generate: 120 frames (4.8 s of audio)"
        time.sleep(1.0)
        p.say("6/6 items, 2s")
    end = time.monotonic()
    lines = [line for _, line in out.stamped]
    assert lines[0] == "torchtitan eval: loading the judges"
    assert lines[-1] == "torchtitan eval: 6/6 items, 2s"
    assert any(line.startswith("torchtitan eval: loading the judges (") for line in lines[1:3])
    assert any("120 frames (4.8 s of audio) (" in line and "s elapsed)" in line for line in lines)
    # never silent for more than the period (+ the heartbeat's polling step and scheduling)
    assert max(gaps([t for t, _ in out.stamped], start, end)) < 0.4 + 0.5, out.stamped


def test_nested_progress_speaks_once_for_a_silence_with_the_innermost_status():
    """A command's heartbeat around a phase's: one line per silence, the phase's status."""
    out = Stamped()
    with Progress("prepare", every=0.3, stream=out) as outer:
        outer.status = "reading the source"
        time.sleep(0.45)
        with Progress("prepare", every=0.3, stream=out) as inner:
            inner.status = "fitting the codec"
            time.sleep(1.0)
        time.sleep(0.45)
    lines = [line for _, line in out.stamped]
    inner_lines = [ln for ln in lines if "fitting the codec" in ln]
    assert len(inner_lines) in (3, 4), lines  # 1.0 s of silence at one line per 0.3 s
    assert lines[0].startswith("prepare: reading the source (")
    assert lines[-1].startswith("prepare: reading the source (")
    stamps = [t for t, _ in out.stamped]
    assert min(b - a for a, b in zip(stamps, stamps[1:], strict=False)) > 0.2  # never twice


def test_no_progress_prints_nothing():
    out = Stamped()
    with Progress("torchtitan generate", enabled=False, every=0.1, stream=out) as p:
        p.say("loading")
        time.sleep(0.3)
    assert out.stamped == []


FAKE_PIP = textwrap.dedent(
    """
    import sys, time
    say = lambda s: print(s, flush=True)
    say("Looking in indexes: https://pypi.org/simple")
    for _ in range(9):
        say("WARNING: Location '/opt/wheels' is ignored: it is either a non-existing path or lacks a specific scheme.")
    say("Collecting torch==2.13.0")
    say("  Downloading torch-2.13.0-cp311-none-linux_x86_64.whl (187.0 MB)")
    say("Requirement already satisfied: numpy in ./.venv/lib/python3.11/site-packages")
    say("Collecting tyro")
    say("WARNING: something else pip wants said")
    say("Installing collected packages: tyro, torch")
    time.sleep(float(sys.argv[1]))  # a large wheel unpacking: pip prints nothing
    say("Successfully installed torch-2.13.0 tyro-1.0.17")
    sys.exit(int(sys.argv[2]))
    """
)


def test_the_install_wrapper_names_what_it_installs_and_is_never_long_silent(tmp_path):
    fake = tmp_path / "fake_pip.py"
    fake.write_text(FAKE_PIP)
    out = Stamped()
    start = time.monotonic()
    code = install_progress.run("torch", [sys.executable, str(fake), "1.5", "0"], out, every=0.4)
    end = time.monotonic()
    lines = [line for _, line in out.stamped]
    assert code == 0
    assert lines[:3] == [
        "[make] installing torch",
        "[make]   collecting torch==2.13.0 (1 so far)",
        "[make]   collecting tyro (2 so far)",
    ]
    assert "[make]   WARNING: something else pip wants said" in lines
    assert "[make]   installing 2 packages (tyro, torch)" in lines
    assert any(line.startswith("[make]   installing 2 packages (tyro, torch) (") for line in lines)
    assert lines[-1].startswith("[make]   installed 2 packages in ")
    assert not [line for line in lines if "Location" in line or "already satisfied" in line]
    # the wrapper's own start-up (a Python process) aside, never silent longer than the period
    stamps = [t for t, _ in out.stamped]
    assert max(gaps(stamps[1:], stamps[1], end)) < 0.4 + 0.5, out.stamped
    assert stamps[0] - start < 0.5


def test_the_install_wrapper_keeps_the_failure(tmp_path):
    fake = tmp_path / "fake_pip.py"
    fake.write_text(FAKE_PIP)
    out = Stamped()
    code = install_progress.run("torch", [sys.executable, str(fake), "0", "3"], out)
    assert code == 3
    assert (
        out.stamped[-1][1] == f"[make]   {sys.executable.rsplit('/', 1)[-1]} failed (exit 3): torch"
    )


FAKE_UV = textwrap.dedent(
    """\
    #!{python}
    import sys, time
    open(sys.argv[0] + ".argv", "w").write("\\n".join(sys.argv[1:]))
    say = lambda s: print(s, flush=True)
    say("Using Python 3.11.7 environment at: .venv")
    say("Resolved 191 packages in 2.73s")
    say("Downloading transformers (13.1MiB)")
    say(" Downloaded transformers")
    time.sleep(0.2)
    say("Prepared 181 packages in 10.35s")
    say("warning: something else uv wants said")
    say("Installed 181 packages in 439ms")
    for name in ("torchtitan==0.2.2", "tyro==1.0.17"):
        say(" + " + name)
    sys.exit({code})
    """
)
# what the fake interpreter answers to `-m pip config list` (a machine's pip configuration);
# any other call is pip itself (FAKE_PIP)
FAKE_PYTHON = textwrap.dedent(
    """\
    #!/bin/sh
    if [ "$2 $3 $4" = "pip config list" ]; then
      echo "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'"
      echo "global.find-links='{missing} {wheels}'"
      echo "global.constraint='{constraints}'"
      echo "global.index-url='https://mirror.example/simple'"
      echo ":env:.index-url='https://pypi.org/simple'"
      echo "global.cert='/etc/ssl/certs/ca-certificates.crt'"
      exit 0
    fi
    exec {python} {fake_pip} 0 0
    """
)


def fake_venv(tmp_path, uv_code: int | None):
    """A venv's bin/ with a fake interpreter (its pip configuration above) and, unless
    ``uv_code`` is None, a fake uv exiting with it."""
    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "constraints.txt").write_text("torch<=2.14.1\n")
    (tmp_path / "fake_pip.py").write_text(FAKE_PIP)
    python = bin_ / "python"
    python.write_text(
        FAKE_PYTHON.format(
            missing=tmp_path / "absent",
            wheels=tmp_path / "wheels",
            constraints=tmp_path / "constraints.txt",
            python=sys.executable,
            fake_pip=tmp_path / "fake_pip.py",
        )
    )
    python.chmod(0o755)
    if uv_code is not None:
        (bin_ / "uv").write_text(FAKE_UV.format(python=sys.executable, code=uv_code))
        (bin_ / "uv").chmod(0o755)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar",
           "off", "--no-compile", "--no-deps", "espnet==202511"]  # fmt: skip
    return bin_, pip


def test_the_uv_install_gets_pips_sources_and_says_what_it_installs(tmp_path):
    """`make`'s --uv steps: uv beside the interpreter installs with the sources pip is
    configured with (the :env: index over the configured one, pip's best-of-all-indexes rule,
    an absent find-links folder left out, the certificate as SSL_CERT_FILE), without pip's own
    options; its lines come out as pip's do."""
    bin_, pip = fake_venv(tmp_path, uv_code=0)
    out = Stamped()
    assert install_progress.run_with_uv("espnet", pip, out, every=0.4) == 0
    lines = [line for _, line in out.stamped]
    assert lines == [
        "[make] installing espnet",
        "[make]   resolved 191 packages",
        "[make]   prepared 181 packages",
        "[make]   warning: something else uv wants said",
        lines[-1],
    ], lines
    assert lines[-1].startswith("[make]   installed 181 packages in ")
    argv = (bin_ / "uv.argv").read_text().split("\n")
    assert argv == [
        "pip", "install", "--python", str(bin_ / "python"),
        "--index-strategy", "unsafe-best-match", "--index-url", "https://pypi.org/simple",
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", str(tmp_path / "wheels"),
        "--constraint", str(tmp_path / "constraints.txt"),
        "--no-deps", "espnet==202511",
    ]  # fmt: skip
    _, env = install_progress.uv_command(pip)
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}


def test_without_uv_or_when_uv_fails_pip_installs(tmp_path):
    bin_, pip = fake_venv(tmp_path, uv_code=None)
    out = Stamped()
    assert install_progress.run_with_uv("torch", pip, out, every=5) == 0
    lines = [line for _, line in out.stamped]
    assert lines[0] == f"[make]   (no uv beside {bin_ / 'python'}: pip installs)"
    assert lines[-1].startswith("[make]   installed 2 packages in "), lines  # FAKE_PIP's
    bin_, pip = fake_venv(tmp_path / "failing", uv_code=2)
    out = Stamped()
    assert install_progress.run_with_uv("torch", pip, out, every=5) == 0
    lines = [line for _, line in out.stamped]
    assert "[make]   uv failed (exit 2): torch" in lines
    assert "[make]   pip installs torch instead" in lines
    assert lines[-1].startswith("[make]   installed 2 packages in "), lines


def test_the_import_check_fails_on_a_module_that_does_not_import_and_leaves_bytecode(
    tmp_path, monkeypatch, capsys
):
    """`make`'s last install step (tools/import_check.py): both groups import at once; one
    that fails fails the step with its error; what imported has its bytecode written."""
    from tools import import_check

    (tmp_path / "okmod.py").write_text("X = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    good = {"first": "import okmod\n", "second": "import json\n"}
    assert import_check.main(good, every=0.2) == 0
    out = capsys.readouterr().out
    assert re.search(r"every dependency imports \(first \d+s, second \d+s\)", out), out
    assert [p.name.split(".")[0] for p in (tmp_path / "__pycache__").iterdir()] == ["okmod"]
    bad = {"first": "import okmod\n", "second": "import no_such_module_here\n"}
    assert import_check.main(bad, every=0.2) == 1
    out = capsys.readouterr().out
    assert "second dependencies do not import" in out and "no_such_module_here" in out, out
    assert "first dependencies" not in out


def test_the_import_check_names_every_module_make_used_to_check():
    """What the install checked before (the package, torchtitan, transformers, wandb, the judges,
    ESPnet's data side, the codecs' packages) is still checked."""
    from tools import import_check

    checked = {m.strip() for m in import_check.PRODUCT.split(",")}
    for module in ("torchtitan_speechlm", "torchtitan", "transformers", "wandb", "soundfile",
                   "pocketsphinx", "resemblyzer", "speechmos.dnsmos", "pyworld",
                   "espnet2.speechlm.dataloader.iterator"):  # fmt: skip
        assert module in checked, module
    assert "package_folder()" in import_check.PRODUCT_CODE
    assert set(import_check.GROUPS.values()) >= {import_check.PRODUCT_CODE}


def test_the_import_check_compiles_the_librosa_kernels_the_judges_call():
    """Its third group imports the module of the mel spectrogram both librosa judges call
    (resemblyzer's and DNSMOS's), whose import compiles librosa's numba kernels."""
    import librosa
    import resemblyzer.audio
    import speechmos.dnsmos

    from tools import import_check

    assert import_check.GROUPS["librosa's kernels"] == f"import {import_check.JIT}\n"
    assert librosa.feature.melspectrogram.__module__ == import_check.JIT
    for judge in (resemblyzer.audio, speechmos.dnsmos):
        assert "librosa.feature.melspectrogram" in inspect.getsource(judge), judge


def test_the_import_check_ends_when_a_group_prints_more_than_a_pipe_holds():
    """A group that writes 1 MB (a pipe holds 64 KiB) still ends and passes."""
    from tools import import_check

    loud = {"loud": "import sys\nsys.stderr.write('w' * 1_000_000)\n", "quiet": "import json\n"}
    assert import_check.main(loud, every=0.2) == 0
