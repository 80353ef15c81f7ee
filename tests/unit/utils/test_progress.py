"""The progress lines of the steps a user waits on: a line at least every `every` seconds while
a step blocks (utils/progress.py's heartbeat, timed here on a real thread), none with
`--no-progress`; and `make`'s install wrapper (tools/install_progress.py) on a real process that
prints pip's kinds of lines with pauses: the noise dropped, a line at least every 5 s, pip's exit
status kept."""

from __future__ import annotations

import io
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


def test_the_compile_step_compiles_on_every_core_and_counts_what_pip_would_skip(tmp_path):
    """`make`'s last install step (--compile): the real compileall over a folder holding a valid
    module and one written for a newer Python (torch ships such files; pip's own compile skips
    them): the valid one is compiled, the other counted, and the step succeeds; a failure with
    no such file behind it (compileall killed, its interpreter missing) keeps its status."""
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "ok.py").write_text("X = 1\n")
    (pkg / "newer.py").write_text("def f[T](a: T) -> T:\n    return a\n")
    out = Stamped()
    cmd = [sys.executable, "-m", "compileall", "-q", "-j", "0", str(pkg)]
    code = install_progress.run("the packages", cmd, out, bytecode=True)
    lines = [line for _, line in out.stamped]
    compiled = [p.name for p in (pkg / "__pycache__").iterdir()]
    if sys.version_info >= (3, 12):  # PEP 695 is valid there: nothing to skip
        assert code == 0 and len(compiled) == 2
        return
    assert code == 0, lines
    assert lines[0] == "[make] compiling the packages"
    assert [n.split(".")[0] for n in compiled] == ["ok"], compiled
    assert lines[-1].startswith("[make]   compiled the packages in ")
    assert lines[-1].endswith("; 1 file invalid for this Python left as source"), lines
    assert not any("SyntaxError" in line or "Error compiling" in line for line in lines), lines
    failed = [sys.executable, "-c", "import sys; print('Killed'); sys.exit(1)"]
    assert install_progress.run("the packages", failed, Stamped(), bytecode=True) == 1
