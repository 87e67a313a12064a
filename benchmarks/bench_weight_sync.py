"""What publishing the policy's weights to the async rollout engine costs, per update.

Two transports of ``rollout.async_steps`` on the same model, publishes interleaved (A B B A):
- ``shm``: the engine process spawned on this machine, weights copied into a shared-memory slot
  (:class:`gspo.rollout.async_engine.AsyncEngine`);
- ``broadcast``: an engine started by ``gspo engine ADDRESS`` in another process, weights sent
  by a ``torch.distributed`` (gloo) broadcast over TCP (:class:`gspo.rollout.remote_engine.
  RemoteEngine`); here over the loopback interface of one machine, so the figure is the
  transport's own cost, without a network's bandwidth limit.

Both engines sit idle (no batch is sampled), so only the publish is timed. The trainer's side
runs with ``--threads`` torch threads; each engine process with one.

    HF_HUB_OFFLINE=1 python -m benchmarks.bench_weight_sync [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from benchmarks.common import abba, fmt, local_address, machine, median, result_name, write_result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--reps", type=int, default=10, help="publishes per transport")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from gspo.models import load_model, token_logprobs
    from gspo.rollout.async_engine import AsyncEngine, Recompute
    from gspo.rollout.engine import EngineOptions
    from gspo.rollout.remote_engine import RemoteEngine

    model, tok = load_model(args.model)
    common = {"engine": "hf", "opts": EngineOptions(), "steps_ahead": 1, "threads": 1,
              "recompute": Recompute(token_logprobs, 1.0, 256, 0)}
    address = local_address()
    server = subprocess.Popen([sys.executable, "-m", "gspo", "engine", address])
    engines = {"shm": AsyncEngine(model, tok, **common),
               "broadcast": RemoteEngine(model, tok, address=address, **common)}
    times: dict[str, list[float]] = {k: [] for k in engines}
    try:
        for version, arm in enumerate(abba(list(engines), args.reps), start=1):
            with torch.no_grad():  # a new version's weights, as after an update
                next(model.parameters()).add_(1e-6)
            start = time.perf_counter()
            engines[arm].publish(model, version)
            times[arm].append(time.perf_counter() - start)
    finally:
        for eng in engines.values():
            eng.close()
        server.wait(timeout=60)
    nbytes = engines["shm"].bytes_per_slot
    rows = [f"| {arm} | {args.threads} + 1 | {len(ts)} | {fmt(median(ts), 3)} | "
            f"{fmt(min(ts), 3)} | {fmt(nbytes / median(ts) / 1e9, 1)} |"
            for arm, ts in times.items()]
    info = machine()
    header = (f"Weight publish per update, {args.model} ({nbytes / 2**20:.0f} MiB), "
              f"{info['cpu']}, {info['time']}, trainer threads {args.threads} + one per "
              f"engine process, publishes interleaved (A B B A).\n\n"
              "| transport | threads (trainer + engine) | publishes | median s | min s | GB/s |\n"
              "|---|---|---|---|---|---|")
    path = write_result(result_name("weight_sync", args.model, args.tag),
                        {"machine": info, "bytes": nbytes, "seconds": times}, header, rows)
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
