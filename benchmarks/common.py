"""Helpers shared by the benchmark scripts: child processes, peak memory, result files.

Every speed comparison runs its arms in alternating child processes (A B B A ...), so that
load from other processes on a shared machine falls on both arms alike, and so that each
arm's peak resident memory (VmHWM) is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# Prompts that ask for long answers, so that (nearly) every response runs to max_new_tokens and
# the compared arms do the same number of token steps.
TOPICS = ["a dragon who learns to cook", "a lighthouse keeper", "a lost robot",
          "a city under the sea", "a clockmaker's apprentice", "a talking cat",
          "a mountain village", "a winter festival", "a pirate librarian", "a desert caravan",
          "a haunted train", "a garden on the moon", "a shy giant", "a forgotten island",
          "a travelling circus", "a river spirit"]
PROMPTS = [f"Write a long story about {t}." for t in TOPICS]
# gspo's default task (short answers, so responses end at different steps), bare and with
# eight worked examples in front (a long shared prompt, as in few-shot math RL).
PAIRS = [(23, 58), (71, 16), (38, 44), (9, 87), (55, 27), (62, 19), (14, 73), (46, 35),
         (81, 12), (27, 64), (33, 48), (15, 76), (68, 29), (42, 51), (19, 34), (57, 66)]
ARITHMETIC = [f"What is {a}+{b}? Answer with a number." for a, b in PAIRS]
SHOTS = "".join(f"What is {a}+{b}? {a + b}\n" for a, b in PAIRS[8:])
PROMPT_SETS = {  # name: (user messages, system prompt; "" = the chat template's default)
    "story": (PROMPTS, ""),
    "arithmetic": (ARITHMETIC, "You are a helpful assistant."),
    "fewshot": ([SHOTS + q for q in ARITHMETIC], "You are a helpful assistant."),
}


def now() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process).

    On a shared machine the CPU time of a one-thread run is the robust measure: it counts only
    the cycles the process got, so load from other processes inflates wall time, not this.
    With several threads it also counts OpenMP spin-waiting, so there it is an upper bound.
    """
    return time.perf_counter(), time.process_time()


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict[str, Any]:
    """What the numbers were measured on (CPU, cores, load, library versions)."""
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines()
                     if x.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    info = {"cpu": cpu, "cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "avx512": any(f.startswith("avx512") for f in flags), "amx": "amx_tile" in flags,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def local_address() -> str:
    """A ``tcp://127.0.0.1:PORT`` address on a port free now, for a trainer and its
    ``gspo engine`` on this machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_time(fn: Any, reps: int, clock: Any = time.perf_counter) -> float:
    """Median seconds of ``reps`` calls of ``fn`` on ``clock`` (wall by default;
    ``time.process_time`` for CPU time), after one uncounted call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return median(times)


def run_child(module: str, spec: dict[str, Any], *, timeout: float = 3600,
              env: dict[str, str] | None = None, python: str | None = None) -> dict[str, Any]:
    """Run ``python -m module --child '<json spec>'``; the child prints one JSON line last.
    ``env``: extra environment variables of the child (read before torch loads); ``python``:
    the interpreter (another venv's), default this one."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", **(env or {}))
    cmd = [python or sys.executable, "-m", module, "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {module} {spec.get('arm', '')} failed (rc {proc.returncode}):"
                           f"\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def thread_children(module: str, doc: str, argv: list[str], reps: int
                    ) -> tuple[argparse.Namespace, dict[int, dict[str, Any]]]:
    """A benchmark's ``--reps`` (default ``reps``), ``--out`` and ``--tag`` from ``argv``, and
    its child process (``python -m module --child``) run at 1 and at 2 threads: their results
    by thread count."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="", help="suffix of the result files' name")
    a = p.parse_args(argv)
    return a, {t: run_child(module, {"threads": t, "reps": a.reps}) for t in (1, 2)}


def report(a: argparse.Namespace, kind: str, res: dict[int, dict[str, Any]], header: str,
           rows: list[str]) -> None:
    """Write :func:`thread_children`'s results as ``<kind>[_<tag>]`` (with the machine) under
    ``--out`` or the results folder, and print the table."""
    write_result("_".join(x for x in (kind, a.tag) if x), {"machine": machine(), "results": res},
                 header, rows, None if a.out is None else Path(a.out))
    print("\n".join([header, *rows]))


def child_main(argv: list[str], run: Any) -> bool:
    """If invoked as a child, run ``run(spec)`` and print its JSON result; return True."""
    if len(argv) >= 2 and argv[0] == "--child":
        spec = json.loads(argv[1])
        out = run(spec)
        out["peak_rss_mb"] = peak_rss_mb()
        print(json.dumps(out), flush=True)
        return True
    return False


def abba(arms: list[str], reps: int) -> list[str]:
    """Arm order for ``reps`` rounds, reversed every other round (A B, B A, A B, ...)."""
    order: list[str] = []
    for r in range(reps):
        order += arms if r % 2 == 0 else arms[::-1]
    return order


def result_name(kind: str, model: str, *parts: str) -> str:
    """``<kind>_<model>[_<part>...]``, the model name made file-safe; empty parts are dropped."""
    return "_".join([kind, model.replace(":", "-").replace("/", "_"), *(x for x in parts if x)])


def write_result(name: str, data: dict[str, Any], md_header: str, md_rows: list[str],
                 out_dir: Path | None = None) -> Path:
    """Write ``<name>.json`` and ``<name>.md`` (a markdown table) under the results folder."""
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")
    (out / f"{name}.md").write_text("\n".join([md_header, *md_rows]) + "\n")
    return path


def fmt(x: float, digits: int = 2) -> str:
    if x != x:  # NaN
        return "–"
    return f"{x:.{digits}f}" if abs(x) < 1e4 else f"{x:.3g}"


def linked_host(i: int, rate: str, made: list[str]) -> tuple[str, str]:
    """A network namespace linked to this one by a veth pair limited to ``rate`` at both ends
    (tc's token bucket filter, burst 2 MB; ``veth``: no limit): (its name, the trainer's
    address for its engine)."""
    ns, here, there = f"gspow{os.getpid() % 10000}_{i}", f"gsw{i}a", f"gsw{i}b"
    subnet = f"10.79.{i}"

    def ip(*a: str) -> None:
        subprocess.run(["ip", *a], check=True, capture_output=True)

    ip("netns", "add", ns)
    made.append(ns)
    ip("link", "add", here, "type", "veth", "peer", "name", there)
    ip("link", "set", there, "netns", ns)
    ip("addr", "add", f"{subnet}.1/24", "dev", here)
    ip("link", "set", here, "up")
    ip("-n", ns, "addr", "add", f"{subnet}.2/24", "dev", there)
    ip("-n", ns, "link", "set", there, "up")
    ip("-n", ns, "link", "set", "lo", "up")
    if rate != "veth":
        for dev, where in ((here, []), (there, ["-n", ns])):
            subprocess.run(["tc", *where, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                            rate, "burst", "2mb", "latency", "100ms"],
                           check=True, capture_output=True)
    with socket.socket() as sock:  # a free port on the trainer's side
        sock.bind((f"{subnet}.1", 0))
        return ns, f"tcp://{subnet}.1:{sock.getsockname()[1]}"


def remove_hosts(made: list[str]) -> None:
    """Delete the namespaces (and with them the veth pairs) that :func:`linked_host` made."""
    for ns in made:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
