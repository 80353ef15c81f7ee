"""`torchtitan train` run in a fork of the test process: the same command, without paying for
Python, torch, torchtitan and transformers to be imported again (about 10 s a process on these
2 cores, three processes for a 2-rank run).

``train(argv, nproc)`` forks a child that runs the console script's own ``main(["train", ...])``
(the launcher's config checks, preflight, resume decision and exit codes, unchanged). For
``--nproc-per-node N > 1`` the child starts its N ranks by forking too, where the product starts
them through torch's elastic launcher (``torch.distributed.run``): each rank gets the variables
torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, ..., MASTER_ADDR/PORT) and runs the same
``commands.train.run_worker``; only rank 0's output is kept, as the launcher's
``--local-ranks-filter 0`` does, and a failed rank is reported the way the launcher reports
torch's ChildFailedError. The ranks are real processes on a real gloo process group: what the
tests prove about distributed training holds as for a user's run. Tests of the launcher itself
(torchrun, SLURM, the console script, killed ranks) keep starting real processes
(``helpers.run_train(..., fresh=True)``).

Forking a process that has imported torch is what torch's own DataLoader workers do; it is safe
here because the test process sets ``OMP_NUM_THREADS=1`` (no OpenMP pool to copy) and holds no
process group when it forks.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

STOP_GRACE = 30.0  # seconds torch's elastic agent gives the other ranks after one failed


@dataclass
class Failure:
    """What torch's ChildFailedError holds per rank (the launcher reads ``exitcode``)."""

    exitcode: int


class RanksFailed(RuntimeError):
    def __init__(self, failures: dict[int, Failure]):
        super().__init__(f"ranks failed: {failures}")
        self.failures = failures


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_code(status: int) -> int:
    """A waitpid status as subprocess reports it (a signal as its negative number)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _fork_ranks(launch) -> None:
    """torch.distributed.run.run for ``launch`` (its parsed arguments), by forking the ranks."""
    from torchtitan_speechlm.commands.train import run_worker

    args = list(launch.training_script_args)
    fork_ranks(int(launch.nproc_per_node), lambda: run_worker(args))


def fork_ranks(n: int, rank_main: Callable[[], int | None]) -> None:
    """``rank_main()`` in ``n`` forked ranks with the variables torchrun sets (only rank 0's
    output kept, as ``--local-ranks-filter 0``); raises RanksFailed as torch's agent raises
    ChildFailedError, after stopping the others when one fails."""
    port = str(_free_port())
    devnull = os.open(os.devnull, os.O_WRONLY)
    pids = {}
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(n):
        pid = os.fork()
        if pid == 0:  # a rank
            os.environ.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", ROLE_RANK=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_RUN_ID="forked",
            )  # fmt: skip
            if rank != 0:  # --local-ranks-filter 0: the other ranks' output is dropped
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
            _run_then_exit(rank_main)
        pids[pid] = rank
    failures: dict[int, Failure] = {}
    stopping_since = None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if stopping_since is not None and time.monotonic() - stopping_since > STOP_GRACE:
                _signal(pids, signal.SIGKILL)
            time.sleep(0.05)
            continue
        rank = pids.pop(pid, None)
        if rank is None:
            continue
        code = _exit_code(status)
        if code != 0:
            failures[rank] = Failure(code)
            if stopping_since is None:  # torch's agent stops the others when a rank fails
                stopping_since = time.monotonic()
                _signal(pids, signal.SIGCONT)
                _signal(pids, signal.SIGTERM)
    if failures:
        raise RanksFailed(failures)


def _run_then_exit(main: Callable[[], int | None]) -> None:
    """In a forked child: ``main()``, then leave with its exit status (SystemExit's code; 1
    and the traceback for any other exception), never returning into the test's code."""
    code = 1
    try:
        code = main() or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _redirect(out: str, err: str) -> None:
    """This process's stdout and stderr (the fds and Python's streams, which pytest replaces
    with its capture) to the files ``out`` and ``err``."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    _python_streams_on_fds()


def _python_streams_on_fds() -> None:
    """Python's ``sys.stdout`` / ``sys.stderr`` written straight to fds 1 and 2, line by line."""
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        os.fdopen(1, "wb", buffering=0, closefd=False), line_buffering=True
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        os.fdopen(2, "wb", buffering=0, closefd=False), line_buffering=True
    )


def _child(main: Callable[[], int], cwd: str | None, out: str, err: str) -> None:
    """The forked command: ``main()`` in ``cwd``, its ranks (if it starts any) forked."""

    def command() -> int:
        os.setpgid(0, 0)  # its ranks join its group: a timeout kills them all
        _redirect(out, err)
        if cwd is not None:
            os.chdir(cwd)
        import torch._inductor.config
        import torch.distributed.run

        torch.distributed.run.run = _fork_ranks  # this child's launcher only
        # a command of ours this one runs (prefer's training rounds) is a fork of it too
        subprocess.run = _run_ours_forked(subprocess.run)
        # inductor's pool of compile workers belongs to the test process (a test that compiled
        # in it started the pool): a fork compiles in its own process instead
        torch._inductor.config.compile_threads = 1
        if os.environ.get("SPEECHLM_FAULTS"):
            # a fresh run arms the faults when its custom_import imports the plugin; this fork
            # has it imported already (by the tests), so it arms them here, the same way
            from tests import fault_injection

            fault_injection.install(os.environ["SPEECHLM_FAULTS"])
        return main()

    _run_then_exit(command)


def _run(
    cmd: list[str], main: Callable[[], int], cwd: str | None, timeout: float
) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(main, cwd, out, err)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.05)
        with open(out, errors="replace") as f, open(err, errors="replace") as g:
            stdout, stderr = f.read(), g.read()
    return subprocess.CompletedProcess(cmd, _exit_code(status), stdout, stderr)


def torchtitan(
    argv: list[str], cwd: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`torchtitan ARGV` (any subcommand; `train --nproc-per-node N` forks its N ranks) in a
    fork of this process; returns what ``subprocess.run(..., capture_output=True, text=True)``
    would."""
    from torchtitan_speechlm import cli

    return _run(["torchtitan", *argv], lambda: cli.main(list(argv)), cwd, timeout)


def python_module(
    module: str, argv: list[str], cwd: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` in a fork of this process (``MODULE.main(argv)``)."""
    import importlib

    def main() -> int:
        return importlib.import_module(module).main(list(argv)) or 0

    return _run(["python", "-m", module, *argv], main, cwd, timeout)


def python_code(
    code: str, cwd: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python -c CODE` in a fork of this process (a fresh namespace)."""

    def main() -> int:
        exec(compile(code, "<example>", "exec"), {"__name__": "__main__"})
        return 0

    return _run(["python", "-c", code], main, cwd, timeout)


def _script_main(path: str, argv: list[str], env: dict[str, str] | None) -> Callable[[], int]:
    """The script at ``path`` run as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as Python
    sets them (its folder first), ``env`` added to the environment."""
    import runpy

    def main() -> int:
        import logging

        root = logging.getLogger()  # as a fresh interpreter has it (pytest's handlers gone)
        root.handlers.clear()
        root.setLevel(logging.WARNING)
        os.environ.update(env or {})
        sys.argv = [path, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        runpy.run_path(path, run_name="__main__")
        return 0

    return main


def python_script(
    path: str,
    argv: list[str],
    cwd: str | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    fork_commands: bool = False,
) -> subprocess.CompletedProcess:
    """`python PATH ARGV` in a fork of this process (``_script_main``). ``fork_commands``: the
    commands of ours the script runs (``ours``) with ``subprocess.run``, or starts with
    ``subprocess.Popen`` to read their output line by line, run as forks too."""
    script = _script_main(path, argv, env)
    if fork_commands:

        def main() -> int:
            subprocess.run = _run_ours_forked(subprocess.run)
            subprocess.Popen = _popen_ours_forked(subprocess.Popen)  # type: ignore[misc]
            return script()

        return _run(["python", path, *argv], main, cwd, timeout)
    return _run(["python", path, *argv], script, cwd, timeout)


def ours(cmd) -> Callable[[], int] | None:
    """The ``main`` of a command line of ours (our console script, its module or file, or a
    Python script of benchmarks/), else None."""
    if isinstance(cmd, str) or not cmd:
        return None
    cmd = [str(c) for c in cmd]
    if os.path.basename(cmd[0]) == "torchtitan":
        args = cmd[1:]
    elif os.path.basename(cmd[0]).startswith("python") and len(cmd) > 1:
        if cmd[1:3] == ["-m", "torchtitan_speechlm.cli"]:
            args = cmd[3:]
        elif cmd[1].endswith(os.path.join("torchtitan_speechlm", "cli.py")):
            args = cmd[2:]
        elif cmd[1].endswith(".py") and os.path.basename(os.path.dirname(cmd[1])) == "benchmarks":
            return _script_main(cmd[1], cmd[2:], None)
        else:
            return None
    else:
        return None

    def main() -> int:
        from torchtitan_speechlm import cli

        return cli.main(list(args)) or 0

    return main


def _run_ours_forked(real_run):
    """``subprocess.run`` whose calls of ``ours`` commands run in a fork of this process (the
    output captured, or passed on to this process's own, as the call asks), others unchanged."""

    def run(cmd, *args, **kw):
        main = ours(cmd)
        if main is None or args or kw.get("input") is not None or kw.get("stdin") is not None:
            return real_run(cmd, *args, **kw)
        env = kw.get("env")

        def with_env() -> int:
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
            return main()

        r = _run(list(map(str, cmd)), with_env, kw.get("cwd"), kw.get("timeout") or 3600)
        captured = kw.get("capture_output") or kw.get("stdout") == subprocess.PIPE
        if not captured:
            sys.stdout.write(r.stdout)
            sys.stderr.write(r.stderr)
            r.stdout = r.stderr = None
        elif not (kw.get("text") or kw.get("universal_newlines") or kw.get("encoding")):
            r.stdout, r.stderr = r.stdout.encode(), r.stderr.encode()
        if kw.get("check") and r.returncode:
            raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr)
        return r

    return run


def _popen_ours_forked(real_popen):
    """``subprocess.Popen`` that starts ``ours`` commands read line by line (stdout a text
    pipe, stderr into it: a server a benchmark starts) as a forked ``Process``; any other call
    is Popen's own."""

    def popen(cmd, *args, **kw):
        main = ours(cmd)
        plain = not args and kw.get("stdout") == subprocess.PIPE
        plain = plain and kw.get("stderr") == subprocess.STDOUT and kw.get("text")
        plain = plain and set(kw) <= {"stdout", "stderr", "text", "env", "cwd", "start_new_session"}
        if main is None or not plain:
            return real_popen(cmd, *args, **kw)
        return Process(list(map(str, cmd)), main, kw.get("env"), kw.get("cwd"),
                       kw.get("start_new_session", False), replace_env=kw.get("env") is not None)  # fmt: skip

    return popen


def python_script_ranks(
    path: str,
    argv: list[str],
    nproc: int,
    cwd: str | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node NPROC PATH ARGV` with its ranks forked from this process
    (``fork_ranks``: torchrun's variables, a real gloo process group, rank 0's output); a
    failed rank is the exit status 1 and a line naming it, as torchrun's."""
    script = _script_main(path, argv, env)

    def main() -> int:
        try:
            fork_ranks(nproc, script)
        except RanksFailed as e:
            print(f"torchrun (forked): {e}", file=sys.stderr)
            return 1
        return 0

    return _run(["torchrun", f"--nproc-per-node={nproc}", path, *argv], main, cwd, timeout)


class Process:
    """``subprocess.Popen(..., stdout=PIPE, stderr=STDOUT, text=True)`` of ``main()`` run in a
    fork of this process (a long-running command, e.g. `torchtitan serve`): ``pid``, ``stdout``
    (its output as text lines), ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``,
    ``returncode``. ``env`` is added to the child's environment."""

    def __init__(self, cmd: list[str], main: Callable[[], int | None],
                 env: dict[str, str] | None = None, cwd: str | None = None,
                 start_new_session: bool = False, replace_env: bool = False):  # fmt: skip
        """``replace_env``: ``env`` is the child's whole environment (Popen's ``env``)."""
        self.args, self.returncode = cmd, None
        read, write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.dup2(write, 1)
            os.dup2(write, 2)
            os.close(write)
            _python_streams_on_fds()
            import logging

            logging.getLogger().handlers.clear()  # as a fresh interpreter has it
            if replace_env:
                os.environ.clear()
            os.environ.update(env or {})
            if start_new_session:
                os.setsid()
            if cwd is not None:
                os.chdir(cwd)
            _run_then_exit(main)
        os.close(write)
        self.pid = pid
        self.stdout = os.fdopen(read, "r", errors="replace")

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = _exit_code(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
