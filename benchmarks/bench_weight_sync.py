"""What publishing the policy's weights to the async rollout engine costs, per update.

Two transports of ``rollout.async_steps`` on the same model, publishes interleaved (A B B A):
- ``shm``: the engine process spawned on this machine, weights copied into a shared-memory slot
  (:class:`gspo.rollout.async_engine.AsyncEngine`);
- ``broadcast``: an engine started by ``gspo engine ADDRESS`` in another process, weights sent
  by a ``torch.distributed`` (gloo) broadcast over TCP (:class:`gspo.rollout.remote_engine.
  RemoteEngine`); here over the loopback interface of one machine, so the figure is the
  transport's own cost, without a network's bandwidth limit.

``--links 10gbit,1gbit,veth``: one more broadcast arm per entry, its engine in a network
namespace of its own (another host, emulated: its own network stack) behind a virtual Ethernet
link whose both ends a ``tc`` token bucket filter (``tbf``, burst 2 MB) limits to that rate
(``veth``: no limit); needs root, and
removes the namespaces and links it made. The publish crosses a real network stack at a
network's rate, not loopback.

Both engines sit idle (no batch is sampled), so only the publish is timed. The trainer's side
runs with ``--threads`` torch threads; each engine process with one.

``--lora R``: the policy wrapped in a LoRA adapter of rank R. Each transport then runs twice:
as gspo publishes (a slot that holds the frozen base weights gets only the adapter) and with
``whole_publish`` (the whole policy every time, as before adapter-only publishing); four arms,
interleaved.

    HF_HUB_OFFLINE=1 python -m benchmarks.bench_weight_sync [--model smollm2-135m-instruct]
    HF_HUB_OFFLINE=1 python -m benchmarks.bench_weight_sync --lora 16 --tag lora
    HF_HUB_OFFLINE=1 python -m benchmarks.bench_weight_sync --links veth,10gbit,1gbit --tag links
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from benchmarks.common import (
    abba,
    fmt,
    linked_host,
    local_address,
    machine,
    median,
    remove_hosts,
    result_name,
    write_result,
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--reps", type=int, default=10, help="publishes per transport")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: the policy as it is)")
    p.add_argument("--links", default="", help="comma list of link rates (tc rate, e.g. "
                   "10gbit; veth: unlimited): a broadcast arm each over an emulated link")
    args = p.parse_args()
    links = [x for x in args.links.split(",") if x]
    if links and args.lora:
        raise SystemExit("--links: with --lora, not built (run them apart)")
    torch.set_num_threads(args.threads)

    from gspo.models import load_model, token_logprobs
    from gspo.rollout.async_engine import AsyncEngine, Recompute
    from gspo.rollout.engine import EngineOptions
    from gspo.rollout.remote_engine import RemoteEngine

    model, tok = load_model(args.model)
    if args.lora:
        from gspo.config import LoRAConfig
        from gspo.models.lora import apply_lora

        model = apply_lora(model, LoRAConfig(r=args.lora, alpha=2 * args.lora))
    common = {"engine": "hf", "opts": EngineOptions(), "steps_ahead": 1, "threads": 1,
              "recompute": Recompute(token_logprobs, 1.0, 256, 0)}
    address = local_address()
    servers = [subprocess.Popen([sys.executable, "-m", "gspo", "engine", address])]
    engines = {"shm": AsyncEngine(model, tok, **common),
               "broadcast": RemoteEngine(model, tok, address=address, **common)}
    if args.lora:
        address = local_address()
        servers.append(subprocess.Popen([sys.executable, "-m", "gspo", "engine", address]))
        engines["shm-whole"] = AsyncEngine(model, tok, **common, whole_publish=True)
        engines["broadcast-whole"] = RemoteEngine(model, tok, address=address, **common,
                                                  whole_publish=True)
    made: list[str] = []  # the namespaces made for --links
    try:
        for i, rate in enumerate(links):
            ns, address = linked_host(i, rate, made)
            servers.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m",
                                             "gspo", "engine", address]))
            engines[f"broadcast-{rate}"] = RemoteEngine(model, tok, address=address, **common)
    except BaseException:
        remove_hosts(made)
        raise
    times: dict[str, list[float]] = {k: [] for k in engines}
    held: dict[str, list[float]] = {k: [] for k in engines}  # the trainer's share of each
    sent: dict[str, list[int]] = {k: [] for k in engines}
    trained = [p for p in model.parameters() if p.requires_grad]
    try:
        for eng in engines.values():  # every slot filled once: what follows is steady state
            eng.publish(model, 1)
        for version, arm in enumerate(abba(list(engines), args.reps), start=2):
            with torch.no_grad():  # a new version's weights, as after an update
                trained[0].add_(1e-6)
            start = time.perf_counter()
            held[arm].append(engines[arm].publish(model, version))
            engines[arm].published()  # the broadcast's end (the trainer trains on meanwhile)
            times[arm].append(time.perf_counter() - start)
            sent[arm].append(engines[arm].last_publish_bytes)
    finally:
        for eng in engines.values():
            eng.close()
        for server in servers:
            server.wait(timeout=60)
        remove_hosts(made)
    nbytes = engines["shm"].bytes_per_slot
    rows = [f"| {arm} | {args.threads} + 1 | {len(ts)} | {fmt(median(ts), 4)} | "
            f"{fmt(min(ts), 4)} | {fmt(median(held[arm]), 4)} | "
            f"{median(sent[arm]) / 2**20:.1f} | {fmt(median(sent[arm]) / median(ts) / 1e9, 1)} |"
            for arm, ts in times.items()]
    info = machine()
    what = f" with a LoRA adapter of rank {args.lora}" if args.lora else ""
    header = (f"Weight publish per update, {args.model}{what} ({nbytes / 2**20:.0f} MiB), "
              f"{info['cpu']}, {info['time']}, trainer threads {args.threads} + one per "
              f"engine process, publishes interleaved (A B B A), after one untimed publish "
              f"into each slot (a slot's first is always of the whole policy).\n\n"
              "Seconds from the call to the weights' arrival; the trainer's share is the time "
              "`publish` holds the trainer (a broadcast goes on in the background while the "
              "trainer trains).\n\n"
              "| transport | threads (trainer + engine) | publishes | median s | min s | "
              "trainer's share, median s | MiB sent (median) | GB/s |\n"
              "|---|---|---|---|---|---|---|---|")
    if links:
        header = (header.split("\n\n")[0] + " Arms broadcast-RATE: the engine in a network "
                  "namespace behind a virtual Ethernet link, both ends limited to RATE by tc's "
                  "token bucket filter (tbf, burst 2 MB; veth: no limit), MTU 1500.\n\n"
                  + header.split("\n\n", 1)[1])
    path = write_result(result_name("weight_sync", args.model, args.tag),
                        {"machine": info, "bytes": nbytes, "seconds": times, "held": held,
                         "bytes_sent": sent, "lora": args.lora, "links": links}, header, rows)
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
