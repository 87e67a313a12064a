"""``gspo compare``: run named arms on the same seeds, prompts and compute budget; report them.

The arms live in a YAML file (``configs/moe/compare.yaml``)::

    base: tiny_moe.yaml          # a run preset (path relative to this file)
    seeds: [0, 1, 2]
    overrides: []                # key=value applied to every arm
    quick:                       # what --quick changes (seconds, for tests)
      seeds: [0, 1]
      overrides: [steps=2]
    arms:
      gspo:
        label: GSPO (eps 3e-4/4e-4)
        overrides: [objective.name=gspo, objective.eps_low=3e-4, objective.eps_high=4e-4]

Each (arm, seed) is one :class:`gspo.trainer.Trainer` run in ``RUNS/<arm>_s<seed>``. A finished
run whose config is unchanged is reused, so an interrupted comparison resumes and a new arm only
costs its own runs. For MoE policies a probe per seed also measures how many expert choices
change after exactly one optimizer step from the initial policy (:func:`first_update_probe`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from gspo.config import ConfigError, TrainConfig, load_config, read_yaml, to_dict

SPEC_KEYS = ("arms", "base", "overrides", "quick", "seeds")
ARM_KEYS = ("label", "overrides")
QUICK_KEYS = ("overrides", "seeds")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
DONE = "compare.json"  # written into a run folder once its run finished


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    overrides: list[str]


@dataclass(frozen=True)
class CompareSpec:
    path: Path
    base: Path | None
    seeds: list[int]
    overrides: list[str]
    arms: list[Arm]

    def config(self, arm: Arm, seed: int, runs_dir: str | Path,
               extra: list[str] | tuple[str, ...] = ()) -> TrainConfig:
        """The run config of ``arm`` for ``seed``: base < spec overrides < arm < ``extra``."""
        fixed = [f"seed={seed}", f"output_dir={runs_dir}", f"run_name={arm.name}_s{seed}"]
        try:
            return load_config(self.base, ["progress=false", *self.overrides, *arm.overrides,
                                           *extra, *fixed])
        except ConfigError as e:
            raise ConfigError(f"{self.path}: arm '{arm.name}': {e}") from None


# ----------------------------------------------------------------------------- the spec file


def _mapping(value: Any, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    unknown = sorted(str(k) for k in value if k not in keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}' (valid: {', '.join(keys)})")
    return value


def _overrides(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of key=value strings, got {value!r}")
    for v in value:
        if "=" not in v:
            raise ConfigError(f"{where}: '{v}' is not key=value")
    return list(value)


def _seeds(value: Any, where: str) -> list[int]:
    ok = (isinstance(value, list) and value and len(set(value)) == len(value)
          and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value))
    if not ok:
        raise ConfigError(f"{where}: expected a non-empty list of distinct integers >= 0, "
                          f"got {value!r}")
    return list(value)


def _arms(value: Any, where: str) -> list[Arm]:
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where}: expected a non-empty mapping of arm name -> arm")
    arms = []
    for name, body in value.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(f"{where}: arm name {name!r} must be letters, digits, _ . -")
        body = _mapping(body if body is not None else {}, f"{where}.{name}", ARM_KEYS)
        label = body.get("label", name)
        if not isinstance(label, str) or not label.strip():
            raise ConfigError(f"{where}.{name}.label: expected a non-empty string")
        arms.append(Arm(name, label, _overrides(body.get("overrides"),
                                                f"{where}.{name}.overrides")))
    return arms


def is_compare_file(path: str | Path) -> bool:
    """Whether ``path`` is a YAML mapping with an ``arms`` key (a comparison, not a run preset)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except Exception:  # unreadable or not YAML: let the run-config loader report it
        return False
    return isinstance(data, dict) and "arms" in data


def load_spec(path: str | Path, *, quick: bool = False, arms: list[str] | None = None,
              seeds: list[int] | None = None) -> CompareSpec:
    """Read and check a comparison file; every arm's run config is built once, so a typo in
    any arm fails here (one-line :class:`ConfigError`) and not hours into the comparison."""
    p = Path(path)
    data = read_yaml(p, "compare file")
    data = _mapping(data, str(p), SPEC_KEYS)
    for key in ("arms", "seeds"):
        if key not in data:
            raise ConfigError(f"{p}: missing '{key}'")
    base = None
    if data.get("base") is not None:
        if not isinstance(data["base"], str):
            raise ConfigError(f"{p}: base: expected a file name, got {data['base']!r}")
        base = p.parent / data["base"]
        if not base.is_file():
            raise ConfigError(f"{p}: base: file not found: {base}")
    all_arms = _arms(data["arms"], f"{p}: arms")
    spec_seeds = _seeds(data["seeds"], f"{p}: seeds")
    common = _overrides(data.get("overrides"), f"{p}: overrides")
    q = _mapping(data.get("quick") or {}, f"{p}: quick", QUICK_KEYS)
    if quick:
        spec_seeds = _seeds(q["seeds"], f"{p}: quick.seeds") if "seeds" in q else spec_seeds
        common += _overrides(q.get("overrides"), f"{p}: quick.overrides")
    if arms:
        known = {a.name for a in all_arms}
        for name in arms:
            if name not in known:
                raise ConfigError(f"--arms: no arm '{name}' in {p} (arms: {', '.join(known)})")
        all_arms = [a for a in all_arms if a.name in arms]
    if seeds is not None:
        spec_seeds = _seeds(seeds, "--seeds")
    spec = CompareSpec(p, base, spec_seeds, common, all_arms)
    for arm in spec.arms:
        spec.config(arm, spec.seeds[0], "runs")
    return spec


# ----------------------------------------------------------------------------- running


def _differs(saved: Any, current: Any) -> bool:
    """Whether two config dicts differ on a key both have (keys added to or removed from
    TrainConfig since the run was saved do not count)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return any(_differs(saved[k], current[k]) for k in saved.keys() & current.keys())
    return saved != current


def _reusable(run_dir: Path, cfg: TrainConfig) -> bool:
    """True for a finished run of ``cfg``; a finished run of another config is an error, an
    unfinished one (no DONE file: interrupted) is deleted so it can start again."""
    if (run_dir / DONE).is_file():
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        if _differs(saved, to_dict(cfg)):
            raise ConfigError(f"{run_dir} holds a finished run of another config; delete it "
                              "or pass --runs DIR")
        return True
    if (run_dir / "config.yaml").is_file():
        shutil.rmtree(run_dir)
    return False


def run_one(cfg: TrainConfig, info: dict[str, Any], log: Callable[[str], None]) -> Path:
    """Train one run (or reuse it); write its wall time and final evaluation to ``DONE``."""
    from gspo.trainer import Trainer

    run_dir = Path(cfg.output_dir) / cfg.run_name
    if _reusable(run_dir, cfg):
        log(f"{cfg.run_name}: finished earlier, reusing {run_dir}")
        return run_dir
    start = time.perf_counter()
    trainer = Trainer(cfg).setup()
    result = trainer.train()
    if result.get("interrupted"):
        raise KeyboardInterrupt
    wall = time.perf_counter() - start
    done = {**info, "wall_s": wall, "before": result.get("before"), "after": result.get("after")}
    (run_dir / DONE).write_text(json.dumps(done, indent=2))
    after = result.get("after") or {}
    acc = f", held-out accuracy after {after['accuracy']:.1%}" if "accuracy" in after else ""
    log(f"{cfg.run_name}: {wall:.0f} s{acc}")
    return run_dir


def expert_change(old: list[torch.Tensor], new: list[torch.Tensor],
                  mask: torch.Tensor) -> torch.Tensor:
    """Per MoE layer ``[L]``: share of the k experts chosen under π_old that the new routing no
    longer chooses, averaged over masked tokens (the paper's "experts that differ")."""
    w = mask.reshape(-1).float()
    out = []
    for a, b in zip(old, new, strict=True):
        kept = (a[:, :, None] == b[:, None, :]).any(-1).float().mean(-1)  # [N]
        out.append(((1 - kept) * w).sum() / w.sum().clamp(min=1))
    return torch.stack(out)


def first_update_probe(cfg: TrainConfig) -> dict[str, Any]:
    """Routing drift after exactly one optimizer step from the initial policy.

    One rollout batch; π_old's expert choices are recorded on all of it; one AdamW step is
    taken on one minibatch (``1/num_minibatches`` of the rows, no replay, no KL); the routing
    of the whole batch is recorded again. At that first step every ratio is 1, so GSPO,
    GSPO-token and GRPO take the same step: one probe per seed serves every arm.
    """
    from gspo.models.moe import routing_change
    from gspo.objectives import ADVANTAGES
    from gspo.rollout import pad_batch
    from gspo.trainer import Trainer
    from gspo.trainer.update import UpdateBatch, policy_update

    trainer = Trainer(cfg).setup()
    if not trainer.moe:
        return {}
    o = cfg.objective
    examples, roll = trainer.rollout()
    rewards, _ = trainer.score(examples, roll)
    adv = ADVANTAGES[o.advantage](rewards, roll.group_size, scale=o.scale_rewards)
    batch = pad_batch(roll.prompt_ids, roll.response_ids, trainer.pad_id, roll.logprobs)
    old, _, routing = trainer.old_logprobs(batch)
    mask = batch["response_mask"]
    full = UpdateBatch(batch["input_ids"], batch["attention_mask"], mask, old, adv, None,
                       routing)
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = torch.randperm(len(roll), generator=gen)[: len(roll) // o.num_minibatches]
    one = dataclasses.replace(o, num_minibatches=1, epochs=1, beta=0.0)
    policy_update(trainer.model, trainer.optimizer, trainer.scheduler,
                  full.rows(rows.sort().values), objective=one,
                  temperature=cfg.rollout.temperature, chunk=cfg.logprob_chunk,
                  grad_clip=cfg.optim.grad_clip, generator=gen)
    _, _, after = trainer.old_logprobs(batch)
    tokens = routing_change(routing, after, mask.reshape(-1))
    experts = expert_change(routing, after, mask)
    return {"token_change": float(tokens["overall"]),
            "token_change_per_layer": [float(v) for v in tokens["per_layer"]],
            "expert_change": float(experts.mean()),
            "expert_change_per_layer": [float(v) for v in experts],
            "n_tokens": float(mask.sum()), "top_k": int(routing[0].shape[-1])}


def run_probe(spec: CompareSpec, seed: int, runs_dir: Path, extra: list[str],
              log: Callable[[str], None]) -> dict[str, Any]:
    cfg = spec.config(spec.arms[0], seed, runs_dir, extra)
    cfg = dataclasses.replace(cfg, run_name=f"probe_s{seed}", steps=0, eval_before=False)
    run_dir = Path(cfg.output_dir) / cfg.run_name
    if _reusable(run_dir, cfg):
        return json.loads((run_dir / DONE).read_text())
    res = first_update_probe(cfg)
    (run_dir / DONE).write_text(json.dumps(res, indent=2))
    if res:
        log(f"probe seed {seed}: after one update {res['token_change']:.1%} of (token, layer) "
            f"changed expert set, {res['expert_change']:.1%} of chosen experts changed")
    return res


def run_compare(spec: CompareSpec, runs_dir: str | Path, out_dir: str | Path,
                extra: list[str] | None = None, log: Callable[[str], None] = print,
                command: str = "") -> dict[str, Any]:
    """Run every (arm, seed), then write ``results.md``, ``summary.json`` and PNGs to out_dir."""
    from gspo.compare_report import summarize, write_report

    runs_dir, out_dir, extra = Path(runs_dir), Path(out_dir), list(extra or [])
    start = time.perf_counter()
    probes = {seed: run_probe(spec, seed, runs_dir, extra, log) for seed in spec.seeds}
    runs: dict[str, dict[int, Path]] = {}
    for seed in spec.seeds:  # seed-major: a partial comparison still covers every arm
        for arm in spec.arms:
            cfg = spec.config(arm, seed, runs_dir, extra)
            info = {"arm": arm.name, "label": arm.label, "seed": seed}
            runs.setdefault(arm.name, {})[seed] = run_one(cfg, info, log)
    summary = summarize(spec, runs, probes)
    summary["total_wall_s"] = time.perf_counter() - start
    summary["command"] = command
    write_report(summary, runs, out_dir)
    return summary


def cmd_compare(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="gspo compare", description="run the arms of a comparison file on the same seeds "
        "and write a results table (results.md) and PNG plots")
    p.add_argument("spec", nargs="?", default="configs/moe/compare.yaml",
                   help="comparison file (default: configs/moe/compare.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every arm")
    p.add_argument("--quick", action="store_true", help="the file's quick setting (seconds)")
    p.add_argument("--arms", default="", help="comma-separated subset of arms")
    p.add_argument("--seeds", default="", help="comma-separated seeds (replaces the file's)")
    p.add_argument("--runs", default="", help="run folders (default: runs/moe_compare[_quick])")
    p.add_argument("--out", default="", help="table and plots (default: results/moe_compare"
                   "[_quick])")
    ns = p.parse_intermixed_args(argv)
    if "=" in ns.spec:  # only overrides were given
        ns.overrides, ns.spec = [ns.spec, *ns.overrides], p.get_default("spec")
    for item in ns.overrides:
        if "=" not in item:
            raise ConfigError(f"expected key=value after the comparison file, got '{item}'")
    try:
        seeds = [int(s) for s in ns.seeds.split(",")] if ns.seeds else None
    except ValueError:
        raise ConfigError(f"--seeds: expected comma-separated integers, got '{ns.seeds}'") from None
    arms = [a for a in ns.arms.split(",") if a] or None
    spec = load_spec(ns.spec, quick=ns.quick, arms=arms, seeds=seeds)
    suffix = "_quick" if ns.quick else ""
    out = ns.out or f"results/moe_compare{suffix}"
    command = " ".join(["gspo compare", *argv])
    summary = run_compare(spec, ns.runs or f"runs/moe_compare{suffix}", out, ns.overrides,
                          command=command)
    print(f"results: {out}/results.md ({len(spec.arms)} arms x {len(spec.seeds)} seeds, "
          f"{summary['total_wall_s'] / 60:.1f} min)")
    return 0
