"""Serving under abuse: issue 51's H1, H2, M1, M2 and M3 run one at a time, each against a
`torchtitan serve` of its own beside normal clients; the normal clients' p95 latency and the
server's peak resident memory during the attack against the same server's idle figures just
before it (targets: p95 within 2x, memory within 1.2x).

The model is bench_serve.py's (a Llama backbone over the tests' tiny Encodec, trained --steps
steps and exported; ``--model DIR`` serves an export instead). Each server runs with its
defaults but API keys from a file (``normal-I`` for normal client I, ``attacker`` for the
attacks: a client of its own, as a real abuser is), ``--max-queued-per-key`` (--per-key, 1: a
key's one request queued or decoding; speech requests join a running batch, so the places a
key holds are its share of the batch) and
``--requests-per-minute`` (--rpm, 360: above a normal client's rate; 0: no limit) and
``--body-mb-per-minute`` (--body-mb, 32: a normal client sends a few hundred bytes a request,
a 60-s prompt upload about 2 MB; 0: no limit). The
normal clients (``--clients`` threads, each its own keep-alive connection) speak one sentence
for exactly ``--frames`` frames in a closed loop for ``--seconds`` per phase. A fresh server per
attack: what one attack leaves in the process (an allocator that keeps what it took) is not
blamed on the next. Each server's phases:

- ``idle``: the normal clients alone (the baseline), after one warm-up request;
- ``h1``: FLAC uploads of ``--h1-hours`` of 48 kHz stereo silence (8 h: 5 MB, ~11 GB as
  float32), one after another, to /v1/audio/transcriptions;
- ``h2``: speech requests whose ``input`` is ``--h2-mb`` MB of text, one after another;
- ``m1``: ``--m1-sockets`` connections trickling a request's headers a byte a second, as many
  sending a body (with the attacker's key) a byte a second; reopened when the server closes
  them;
- ``m2``: bursts of ``--m2-concurrent`` speech requests at once (the attacker's key), one
  burst after another;
- ``m3``: ``--m3-requests`` speech requests (the longest text) whose clients close their
  connection as soon as they are sent, every second.

The server's resident memory (its process's VmRSS) is read every 20 ms; a phase's peak is the
highest read during it; the idle figure is the idle phase's peak. ``--pin`` (the default on 2 or
more cores): the server runs on the first half of this machine's cores (its torch threads as
many) and this script's clients, normal and attacking, on the other half, so that what is
measured is what the attacks cost the server, not the attacker's own CPU (a remote attacker
pays for its own; here every client shares the machine). For each attack its answers
are counted by status (and whether every refusal is JSON with ``Retry-After`` where it is for
load). Beside the normal clients' own p95 (what they waited, their threads' waits included),
each phase has the server's side of it (``normal_server_side``: their requests' times in the
server's access log, from its arrival to its access line) and the server's CPU time per second
(``server_cpu_per_s``). ``--attacker-process``: the attack runs in a process of its own, in a
session of its own as the server is (its threads then share neither the normal clients'
interpreter lock nor, where the kernel groups processes by session for scheduling (autogroup),
the server's share of its core: on a machine other sessions load, a flood of 401s took the
server from 0.50 to 0.31 cores without it). Results: benchmarks/results/serve_abuse_cpu.json
(M2 alone, with and without ``--attacker-process``: serve_abuse_cpu_m2*.json).

    python benchmarks/bench_serve_abuse.py [--frames 25] [--clients 2] [--seconds 20] [--attacks h1,h2,m1,m2,m3]
    python benchmarks/bench_serve_abuse.py --model DIR --seconds 30
    python benchmarks/bench_serve_abuse.py --rpm 0 --per-key 8 --out benchmarks/results/serve_abuse_cpu_no_limits.json
    python benchmarks/bench_serve_abuse.py --attacks m2 --attacker-process --out benchmarks/results/serve_abuse_cpu_m2_attacker_process.json

Smallest setting (a smoke test of the script): ``--frames 2 --clients 1 --seconds 2 --hidden
32 --layers 1 --h1-hours 0.02 --h2-mb 1 --m1-sockets 4 --m2-concurrent 8 --m3-requests 4
--work DIR --out FILE``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import SENTENCES, Server, make_model, rss_kb, summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ATTACKER = "attacker-key-9876543210"
TARGETS = {"p95_ratio_max": 2.0, "memory_ratio_max": 1.2}
ATTACK_NAMES = ("h1", "h2", "m1", "m2", "m3")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="serve this export (default: make bench_serve.py's)")
    p.add_argument("--frames", type=int, default=25, help="frames per normal request (25 = 0.5 s)")
    p.add_argument("--clients", type=int, default=2, help="normal client threads")
    p.add_argument("--seconds", type=float, default=20.0, help="each phase's length")
    p.add_argument("--attacks", default=",".join(ATTACK_NAMES), help="which attacks, in order")
    p.add_argument("--per-key", type=int, default=1, help="the server's --max-queued-per-key: "
                   "a key's requests queued or decoding (1: one in flight, a closed-loop "
                   "client's need)")  # fmt: skip
    p.add_argument("--rpm", type=int, default=360, help="the server's --requests-per-minute")
    p.add_argument("--body-mb", type=float, default=32.0,
                   help="the server's --body-mb-per-minute (0: no limit)")  # fmt: skip
    p.add_argument("--h1-hours", type=float, default=8.0, help="H1's upload: hours of silence")
    p.add_argument("--h2-mb", type=float, default=10.0, help="H2's input: MB of text")
    p.add_argument(
        "--m1-sockets", type=int, default=150, help="M1: trickling connections, each kind"
    )
    p.add_argument("--m2-concurrent", type=int, default=200, help="M2: requests per burst")
    p.add_argument("--m3-requests", type=int, default=64, help="M3: requests left each second")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="training steps before the export")
    p.add_argument("--device", default="cpu")
    p.add_argument("--attacker-process", action=argparse.BooleanOptionalAction, default=False,
                   help="run the attack in a process of its own (default: threads of this "
                   "script, beside the normal clients' and sharing their interpreter lock)")  # fmt: skip
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                   help="the server on half the cores, the clients on the other half (default: "
                   "on with 2 or more cores)")  # fmt: skip
    p.add_argument(
        "--work", help="where the model and the H1 file are made (default: a temp folder)"
    )
    p.add_argument(
        "--out", help="the result JSON (default: benchmarks/results/serve_abuse_cpu.json)"
    )
    return p


# ---- the server --------------------------------------------------------------------------
def split_cores() -> tuple[set[int], set[int]]:
    """(the server's cores, the clients'): the allowed cores in two halves."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    return set(cores[:half]), set(cores[half:])


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` on ``cores`` (threads it makes later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass


def start_server(a, model: str, work: str) -> Server:
    """`torchtitan serve` with the keys file and the per-key queue share (bench_serve's
    Server: its decoding flags make every normal request exactly --frames frames), on its
    cores with ``--pin``."""
    path = os.path.join(work, "keys.txt")
    with open(path, "w") as f:
        f.write("".join(f"{name} {key}\n" for name, key in keys(a.clients).items()))
    a.max_batch, a.batch_wait_ms, a.replicas, a.slow_seconds = 8, 10.0, 1, 60.0
    limits = ["--max-queued-per-key", str(a.per_key), "--requests-per-minute", str(a.rpm),
              "--body-mb-per-minute", f"{a.body_mb:g}"]  # fmt: skip
    server = Server(a, model, ["--api-key-file", path, *limits], own_session=a.attacker_process)
    if a.pin:
        pin(server.proc.pid, a.server_cores)
    return server


class MemoryWatch:
    """The server's VmRSS every 20 ms; ``peak()`` since the last ``reset()`` (MB)."""

    def __init__(self, pid: int):
        self.pid, self._peak, self._stop = pid, 0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._peak = max(self._peak, rss_kb(self.pid))

    def reset(self) -> None:
        self._peak = rss_kb(self.pid)

    def peak(self) -> float:
        return round(self._peak / 1024, 1)

    def close(self) -> None:
        self._stop.set()


def post(server: Server, path: str, body: bytes, headers: dict, timeout: float = 600):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("POST", path, body, headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    finally:
        conn.close()


def keys(clients: int) -> dict[str, str]:
    """The key file's names and keys: one per normal client, and the attacker's."""
    return {**{f"normal-{i}": f"normal-key-{i}-0123456789" for i in range(clients)},
            "attacker": ATTACKER}  # fmt: skip


def auth(who: str, content_type: str = "application/json") -> dict:
    key = ATTACKER if who == "attacker" else keys(int(who.split("-")[1]) + 1)[who]
    return {"Authorization": f"Bearer {key}", "Content-Type": content_type}


def speech_body(text: str) -> bytes:
    return json.dumps({"model": "m", "input": text, "voice": "alloy"}).encode()


# ---- the normal clients ------------------------------------------------------------------
def normal_clients(server: Server, n: int, stop: threading.Event) -> dict:
    """``n`` closed-loop clients until ``stop``: their latencies and failures."""
    latencies: list[float] = []
    failures: Counter = Counter()
    lock = threading.Lock()

    def client(i: int) -> None:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
        k = i
        while not stop.is_set():
            t = time.perf_counter()
            body = speech_body(SENTENCES[k % 4])
            try:
                conn.request("POST", "/v1/audio/speech", body, auth(f"normal-{i}"))
                r = conn.getresponse()
                status = str(r.status) if len(r.read()) > 44 or r.status != 200 else "empty"
            except OSError as e:
                conn.close()
                conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
                status = type(e).__name__
            with lock:
                if status == "200":
                    latencies.append(time.perf_counter() - t)
                else:
                    failures[status] += 1
            k += n

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(600)
    out = summary(latencies, time.perf_counter() - t0) if latencies else {"requests": 0}
    out["failed"] = dict(failures)
    return out


# ---- the attacks -------------------------------------------------------------------------
def silence_flac(path: str, hours: float) -> str:
    """``hours`` of 48 kHz stereo silence as FLAC (made once: 8 h take ~35 s)."""
    if os.path.isfile(path):
        return path
    import numpy as np
    import soundfile as sf

    block = np.zeros((48000 * 60, 2), np.int16)
    left = int(hours * 3600 * 48000)
    with sf.SoundFile(path + ".tmp", "w", 48000, 2, format="FLAC", subtype="PCM_16") as f:
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
    os.replace(path + ".tmp", path)
    return path


def refusal_ok(status: int, head: dict, body: bytes) -> bool:
    """A refusal in OpenAI's JSON; with Retry-After when it is for load (429, 503)."""
    try:
        json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return False
    return status not in (429, 503) or "retry-after" in head


class Attack:
    """An attack's loop on a thread until ``stop``; ``stats`` counts its answers."""

    def __init__(self, server: Server, stop: threading.Event):
        self.server, self.stop = server, stop
        self.stats: Counter = Counter()
        self.refusals_ok = True
        self.threads: list[threading.Thread] = []

    def send(self, path: str, body: bytes, headers: dict) -> None:
        """One request, its answer recorded (a connection the server closed: its error)."""
        try:
            self.record(*post(self.server, path, body, headers, timeout=120))
        except OSError as e:  # a refusal that closes the connection while the body is sent
            self.stats[type(e).__name__] += 1

    def record(self, status: int, head: dict, body: bytes) -> None:
        self.stats[str(status)] += 1
        if status >= 400 and not refusal_ok(status, head, body):
            self.refusals_ok = False

    def start(self, loop) -> None:
        self.threads.append(threading.Thread(target=loop, daemon=True))
        self.threads[-1].start()

    def join(self) -> dict:
        for t in self.threads:
            t.join(120)
        return {
            "answers": dict(self.stats),
            "every_refusal_json_with_retry_after": self.refusals_ok,
        }


def h1(attack: Attack, a, work: str) -> None:
    name = f"silence_{a.h1_hours:g}h.flac"
    data = open(silence_flac(os.path.join(work, name), a.h1_hours), "rb").read()
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + name.encode()
            + b"\"\r\nContent-Type: audio/flac\r\n\r\n" + data + b"\r\n--XyZ--\r\n")  # fmt: skip
    headers = auth("attacker", "multipart/form-data; boundary=XyZ")

    def loop() -> None:
        while not attack.stop.is_set():
            attack.send("/v1/audio/transcriptions", body, headers)

    attack.start(loop)


def h2(attack: Attack, a, work: str) -> None:
    body = speech_body("word " * int(a.h2_mb * (1 << 20) / 5))

    def loop() -> None:
        while not attack.stop.is_set():
            attack.send("/v1/audio/speech", body, auth("attacker"))

    attack.start(loop)


def m1(attack: Attack, a, work: str) -> None:
    server = attack.server
    head = b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\n"
    slow_body = (head + b"Authorization: Bearer " + ATTACKER.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")  # fmt: skip

    def loop() -> None:
        socks: list[tuple[socket.socket, bytes, int]] = []
        while not attack.stop.is_set():
            while len(socks) < 2 * a.m1_sockets:
                kind = head if len(socks) % 2 else slow_body
                try:
                    s = socket.create_connection((server.host, server.port), timeout=5)
                except OSError:
                    attack.stats["connect_failed"] += 1
                    break
                socks.append((s, kind, 0))
                attack.stats["opened"] += 1
            kept = []
            for s, kind, sent in socks:
                piece = kind[sent : sent + 1] if sent < len(kind) else b" "
                try:
                    s.sendall(piece)
                    kept.append((s, kind, sent + 1))
                except OSError:  # closed by the server: --header-timeout / --body-timeout
                    attack.stats["closed_by_server"] += 1
                    s.close()
            socks = kept
            attack.stop.wait(1.0)
        for s, _, _ in socks:
            s.close()

    attack.start(loop)


def m2(attack: Attack, a, work: str) -> None:
    def one(i: int) -> None:
        attack.send("/v1/audio/speech", speech_body(SENTENCES[i % 4]), auth("attacker"))

    def loop() -> None:
        while not attack.stop.is_set():
            burst = [threading.Thread(target=one, args=(i,)) for i in range(a.m2_concurrent)]
            for t in burst:
                t.start()
            for t in burst:
                t.join(180)
            attack.stats["bursts"] += 1

    attack.start(loop)


def m3(attack: Attack, a, work: str) -> None:
    server = attack.server
    body = speech_body(" ".join(SENTENCES))
    request = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
               + ATTACKER.encode() + b"\r\nContent-Type: application/json\r\n"
               + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip

    def loop() -> None:
        while not attack.stop.is_set():
            for _ in range(a.m3_requests):
                try:
                    with socket.create_connection((server.host, server.port), timeout=5) as s:
                        s.sendall(request)
                    attack.stats["left"] += 1
                except OSError:
                    attack.stats["connect_failed"] += 1
            attack.stop.wait(1.0)

    attack.start(loop)


ATTACKS = {"h1": h1, "h2": h2, "m1": m1, "m2": m2, "m3": m3}


class AttackProcess:
    """``--attacker-process``: the attack ``name`` in a forked process of its own (on the
    clients' cores), so that its threads do not take the interpreter lock the normal
    clients' threads and the server's stdout reader need; ``join`` as ``Attack``'s."""

    def __init__(self, name: str, a, server: Server, work: str):
        ctx = multiprocessing.get_context("fork")
        self.stop = ctx.Event()
        self._answers, sender = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_attack_child, args=(name, a, server, work, self.stop,
                                                            sender), daemon=True)  # fmt: skip
        self.proc.start()

    def join(self) -> dict:
        self.stop.set()
        got = self._answers.recv() if self._answers.poll(180) else {"answers": "none (hung)"}
        self.proc.join(30)
        return got


def _attack_child(name: str, a, server: Server, work: str, stop, sender) -> None:
    os.setsid()  # a scheduling group of its own (autogroup): its load is not the clients'
    own = threading.Event()
    attack = Attack(server, own)
    ATTACKS[name](attack, a, work)
    stop.wait()
    own.set()
    sender.send(attack.join())


def cpu_s(pid: int) -> float:
    """``pid``'s CPU time so far (user + system, all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_side(server: Server, first_line: int) -> dict:
    """The normal clients' answered speech requests as the server's access log timed them
    (from its arrival to its access line: no client-side waits), since ``first_line``."""
    ms = []
    for line in server.lines[first_line:]:
        if line.startswith('{"method": "POST"'):
            record = json.loads(line)
            if record.get("status") == 200 and str(record.get("key", "")).startswith("normal-"):
                ms.append(record["ms"] / 1000)
    return summary(ms, 1.0) if ms else {"requests": 0}


def phase(name: str, a, server: Server, memory: MemoryWatch, work: str) -> dict:
    """The normal clients for --seconds, beside the attack ``name`` (none: idle)."""
    stop = threading.Event()
    attack: Attack | AttackProcess = Attack(server, stop)
    if name in ATTACKS:
        if a.attacker_process:
            attack = AttackProcess(name, a, server, work)
        else:
            ATTACKS[name](attack, a, work)
    memory.reset()
    first_line = len(server.lines)
    cpu0, wall0 = cpu_s(server.proc.pid), time.perf_counter()
    timer = threading.Timer(a.seconds, stop.set)
    timer.start()
    normal = normal_clients(server, a.clients, stop)
    out = {"normal": normal, "server_peak_rss_mb": memory.peak()}
    # the server's CPU time over the phase, per second of it (1.0: one core all the time)
    out["server_cpu_per_s"] = round(
        (cpu_s(server.proc.pid) - cpu0) / (time.perf_counter() - wall0), 2
    )
    if name in ATTACKS:
        out["attack"] = attack.join()
    time.sleep(0.5)  # the last access lines
    served = server_side(server, first_line)
    out["normal_server_side"] = {k: served[k] for k in ("requests", "p50_ms", "p95_ms")
                                 if k in served}  # fmt: skip
    out["server_rss_after_mb"] = round(rss_kb(server.proc.pid) / 1024, 1)
    return out


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    a.out = a.out or str(ROOT / "benchmarks" / "results" / "serve_abuse_cpu.json")
    a.engines = "ours"  # bench_serve's model: the delay pattern
    work = a.work or tempfile.mkdtemp(prefix="bench_serve_abuse_")
    os.makedirs(work, exist_ok=True)
    made = os.path.join(work, "model", "export")  # a --work of an earlier run: its model
    model = a.model or (made if os.path.isdir(made) else make_model(a, work))
    a.pin = len(os.sched_getaffinity(0)) >= 2 if a.pin is None else a.pin
    if a.pin:
        a.server_cores, client_cores = split_cores()
        os.environ["OMP_NUM_THREADS"] = str(len(a.server_cores))  # the server's torch threads
        os.sched_setaffinity(0, client_cores)  # this process: the clients
    import torch

    result = {
        "model": "given" if a.model else {"family": "llama", "hidden": a.hidden,
                                          "layers": a.layers, "heads": a.heads},
        "frames_per_normal_request": a.frames,
        "normal_clients": a.clients,
        "seconds_per_phase": a.seconds,
        "server_flags": "defaults, --api-key-file (normal-0.., attacker), "
                        f"--max-queued-per-key {a.per_key}, --requests-per-minute {a.rpm}, "
                        f"--body-mb-per-minute {a.body_mb:g}, "
                        f"--min/--max-frames {a.frames}",
        "attack_sizes": {"h1_hours": a.h1_hours, "h2_mb": a.h2_mb, "m1_sockets_each_kind":
                         a.m1_sockets, "m2_concurrent": a.m2_concurrent, "m3_requests_per_s":
                         a.m3_requests},
        "targets": TARGETS,
        "device": a.device,
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "attacker": "its own process" if a.attacker_process else "threads of the clients' process",
        "pinned": {"server_cores": sorted(a.server_cores),
                   "client_cores": sorted(os.sched_getaffinity(0))} if a.pin else False,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "attacks": {},
    }  # fmt: skip
    for name in a.attacks.split(","):
        server = start_server(a, model, work)
        memory = MemoryWatch(server.proc.pid)
        try:
            post(server, "/v1/audio/speech", speech_body(SENTENCES[0]), auth("normal-0"))  # warm
            got = {"server_start_s": server.start_s}
            for kind in ("idle", name):
                got[kind] = phase(kind, a, server, memory, work)
        finally:
            memory.close()
            got["server_exit_status_on_sigterm"] = server.close()
        result["attacks"][name] = got
        print(json.dumps({name: got}), flush=True)
    judge(result)
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result["verdict"], indent=1))
    print(f"wrote {a.out}")


def judge(result: dict) -> None:
    """Each attack against its server's idle phase: p95 and peak memory ratios, targets met."""
    verdict = {}
    for name, got in result["attacks"].items():
        idle, under = got["idle"], got[name]
        if not under["normal"].get("requests") or not idle["normal"].get("requests"):
            verdict[name] = {
                "normal_requests_answered": 0,
                "normal_failed": under["normal"]["failed"],
            }
            continue
        p95 = under["normal"]["p95_ms"] / idle["normal"]["p95_ms"]
        inside = [got[k].get("normal_server_side", {}).get("p95_ms") for k in ("idle", name)]
        mem = under["server_peak_rss_mb"] / idle["server_peak_rss_mb"]
        verdict[name] = {
            "idle_p95_ms": idle["normal"]["p95_ms"], "p95_ms": under["normal"]["p95_ms"],
            "p95_ratio": round(p95, 2),
            "server_side_p95_ms": inside,
            "server_side_p95_ratio": round(inside[1] / inside[0], 2) if all(inside) else None,
            "idle_peak_rss_mb": idle["server_peak_rss_mb"],
            "peak_rss_mb": under["server_peak_rss_mb"], "memory_ratio": round(mem, 3),
            "p95_within_target": p95 <= TARGETS["p95_ratio_max"],
            "memory_within_target": mem <= TARGETS["memory_ratio_max"],
            "normal_failed": under["normal"]["failed"],
            "attack_answers": under["attack"]["answers"],
        }  # fmt: skip
    result["verdict"] = verdict


if __name__ == "__main__":
    main()
