"""Routing volatility: the share of π_old's experts replaced after one optimizer step, per layer.

Each setting (testbed × learning rate × router state) runs a few real RL steps in its own child
process through the trainer's own ``train_step`` with ``objective.num_minibatches=2`` and no
routing replay: the second minibatch of every step is routed after exactly one AdamW step on
the first, so its ``moe/expert_change_layer{i}`` is the paper's "experts that differ after one
update" (arXiv:2507.18071 v2, Sec. 5.3: about 10% on Qwen3-30B-A3B, 48 layers, 128 experts,
top-8). Step 1 measures the starting router state; later steps the router after that many RL
updates. Router states: the upcycled model's router init scale ``router_std`` (the logit scale,
i.e. an inverse router temperature; routing at init does not change the function, see
gspo/models/upcycle.py) and ``noise`` (expert symmetry breaking); the deep tiny MoE's router as
the SFT cold start left it.

    python -m benchmarks.bench_routing_volatility            # both testbeds (~15 min here)
    python -m benchmarks.bench_routing_volatility --only deep
    python -m benchmarks.bench_routing_volatility --only granularity  # 32 vs 128 experts
    python -m benchmarks.bench_routing_volatility --only router  # routers' own lr, 1-100x
    python -m benchmarks.bench_routing_volatility --only upcycled-router  # the same, upcycled

Writes results/moe_volatility/volatility_<grid>.{json,md}, grid one of all, deep, upcycled,
granularity, router, upcycled-router.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

from benchmarks.common import ROOT, child_main, machine, run_child, write_result

OUT = ROOT / "results" / "moe_volatility"
UPCYCLED = "upcycle:smollm2-135m-instruct?experts=4&top_k=2&noise={noise}&router_std={std}"
# (testbed, lr, router state, steps): the grid that fits about 15 minutes on 2 busy cores.
GRID: list[tuple[str, float, dict[str, float], int]] = [
    *[("deep", lr, {}, 4) for lr in (3e-5, 1e-4, 3e-4, 1e-3)],
    *[("upcycled", lr, {"std": 0.02, "noise": 0.01}, 2) for lr in (1e-5, 1e-4)],
    ("upcycled", 1e-5, {"std": 0.002, "noise": 0.01}, 2),
    ("upcycled", 1e-5, {"std": 0.2, "noise": 0.01}, 2),
    ("upcycled", 1e-5, {"std": 0.02, "noise": 0.0}, 2),
]
# Expert granularity at equal active compute (``--only granularity``): deep_moe (32 experts,
# top-4) against deep_moe_128 (128 half-width experts, top-8, the paper's count and top-k),
# both from the 700-step SFT cold start of configs/moe/deep_moe.yaml.
GRANULARITY: list[tuple[str, float, dict[str, float], int]] = [
    (testbed, lr, {}, 4) for lr in (1e-4, 3e-4, 1e-3) for testbed in ("deep-700", "deep128-700")]
# The routers' own learning rate (``--only router``, ``moe.router_lr_scale``): deep_moe from
# the 700-step cold start at lr 1e-4, the rate where every arm of the comparison trains, with
# the routers alone at 1, 10, 30 and 100 × that rate.
ROUTER: list[tuple[str, float, dict[str, float], int]] = [
    ("deep-700", 1e-4, {"router_lr_scale": scale}, 6) for scale in (1, 10, 30, 100)]
# The same on the upcycled model (``--only upcycled-router``): lr 3e-5, the rate where its
# comparison's arms train (1.5-2.2% of experts per update at scale 1), the routers at 3, 10
# and 30 x that rate; 3 RL steps each (one upcycled step is ~35 s on one thread here).
UPCYCLED_ROUTER: list[tuple[str, float, dict[str, float], int]] = [
    ("upcycled", 3e-5, {"std": 0.02, "noise": 0.01, "router_lr_scale": scale}, 3)
    for scale in (3, 10, 30)]
DEEP_MODELS = {"deep": "sft:deep_moe", "deep-700": "sft:deep_moe?steps=700",
               "deep128-700": "sft:deep_moe_128?steps=700"}


def overrides(testbed: str, lr: float, state: dict[str, float], steps: int) -> list[str]:
    common = [f"optim.lr={lr}", f"steps={steps}", "objective.num_minibatches=2",
              "moe.routing_replay=off", "eval_before=false", "progress=false",
              "tensorboard=false", "logging.samples_every=0", "num_threads=1"]
    if "router_lr_scale" in state:
        common.append(f"moe.router_lr_scale={state['router_lr_scale']:g}")
    if testbed in DEEP_MODELS:
        return [*common, f"model={DEEP_MODELS[testbed]}", "task.levels=[2,3]",
                "task.system_prompt=",
                "rollout.max_new_tokens=12", "rollout.prompts_per_step=8"]
    return [*common, f"model={UPCYCLED.format(**state)}"]


def run_setting(spec: dict[str, Any]) -> dict[str, Any]:
    """Child: ``steps`` RL steps; per step, per layer, the share of experts replaced."""
    import torch

    from gspo.config import load_config
    from gspo.trainer import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [*spec["overrides"], f"output_dir={out}", "run_name=vol"])
        trainer = Trainer(cfg).setup()
        steps = []
        for _ in range(cfg.steps):
            m = trainer.train_step()
            layers = sorted((k for k in m if k.startswith("moe/expert_change_layer")
                             and k.endswith("_after_update")),
                            key=lambda k: int(k.split("layer")[1].split("_")[0]))
            steps.append({"expert_change": m.get("moe/expert_change_after_update"),
                          "token_change": m.get("moe/routing_change_after_update"),
                          "per_layer": [m[k] for k in layers],
                          "router_entropy": m.get("moe/router_entropy"),
                          "load_imbalance": m.get("moe/load_imbalance"),
                          "reward": m.get("reward/mean"), "grad_norm": m.get("train/grad_norm")})
        trainer.cleanup()
    return {"steps": steps}


def main(argv: list[str]) -> None:
    if child_main(argv, run_setting):
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["deep", "upcycled", "granularity", "router",
                                       "upcycled-router"],
                    default=None, help="one testbed of the default grid, or the granularity "
                    "or a router-lr grid")
    args = ap.parse_args(argv)
    results, rows = [], []
    special = {"granularity": GRANULARITY, "router": ROUTER, "upcycled-router": UPCYCLED_ROUTER}
    grid = special.get(args.only or "", GRID)
    for testbed, lr, state, steps in grid:
        if args.only not in (None, *special, testbed):
            continue
        res = run_child("benchmarks.bench_routing_volatility",
                        {"overrides": overrides(testbed, lr, state, steps)}, timeout=1800)
        results.append({"testbed": testbed, "lr": lr, "router_state": state, **res})
        for i, s in enumerate(res["steps"], 1):
            per = s["per_layer"]
            row = (f"| {testbed} | {lr:g} | {state or 'SFT cold start'} | {i} | "
                   f"{s['expert_change']:.2%} | {max(per):.2%} (layer {per.index(max(per))}) | "
                   f"{s['token_change']:.2%} | {s['router_entropy']:.3f} | "
                   f"{s['load_imbalance']:.2f} | {s['reward']:.3f} |")
            rows.append(row)
            print(row, flush=True)
    cmd = "python -m benchmarks.bench_routing_volatility " + " ".join(argv)
    header = (
        "# Routing volatility after one optimizer step\n\n"
        f"`{cmd}`. Share of π_old's experts replaced after one AdamW step (mean over MoE "
        "layers, and the most volatile layer), the share of (token, layer) whose expert set "
        "changed, router entropy / log E and load imbalance (max/mean expert load), per RL "
        "step, and the step's reward per sampled response.\n\n| testbed | lr | router state | "
        "step | experts replaced | worst layer | expert set changed | router entropy | "
        "load imbalance | reward |\n|---|---|---|---|---|---|---|---|---|---|")
    write_result(f"volatility_{args.only or 'all'}", {"machine": machine(), "grid": results},
                 header, rows,
                 out_dir=OUT)


if __name__ == "__main__":
    main(sys.argv[1:])
