"""The comparison file of ``gspo compare``: named arms over a base preset, seeds, overrides.

The arms live in a YAML file (the preset ``moe/compare``, ``gspo/presets/moe/compare.yaml``)::

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

:func:`load_spec` checks the file and builds every arm's run config once, so a typo fails
before any run starts, with and without the ``quick`` settings. Reading a spec needs no model
code (``gspo validate`` uses it).

``gspo compare`` sets each run's ``seed``, ``output_dir`` and ``run_name`` itself, and starts
it afresh (no ``resume``)
(:data:`FIXED_KEYS`): an override of one of them, in the file or on the command line, is an
error, as is a key (an arm name, say) given twice in one mapping of the file
(:func:`gspo.config.read_yaml`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gspo.config import ConfigError, TrainConfig, load_config, read_yaml, resolve_path

SPEC_KEYS = ("arms", "base", "overrides", "quick", "seeds")
ARM_KEYS = ("label", "overrides")
QUICK_KEYS = ("overrides", "seeds")
# set per run by CompareSpec.config (the seed of the run, its folder; each run starts afresh
# there or is reused whole): never by an override
FIXED_KEYS = ("seed", "output_dir", "run_name", "resume")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


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
    # the file's first arm, whichever subset ``--arms`` picked: the routing probe runs with its
    # config, so subsets run as separate processes into one runs folder share a probe per seed
    probe_arm: Arm

    def config(self, arm: Arm, seed: int, runs_dir: str | Path,
               extra: list[str] | tuple[str, ...] = ()) -> TrainConfig:
        """The run config of ``arm`` for ``seed``: base < spec overrides < arm < ``extra``."""
        check_not_fixed(extra, "command line")
        fixed = [f"seed={seed}", f"output_dir={runs_dir}", f"run_name={arm.name}_s{seed}"]
        try:
            return load_config(self.base, ["progress=false", *self.overrides, *arm.overrides,
                                           *extra, *fixed])
        except ConfigError as e:
            raise ConfigError(f"{self.path}: arm '{arm.name}': {e}") from None


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


def check_not_fixed(overrides: list[str] | tuple[str, ...], where: str) -> None:
    """Refuse an override of a key that ``gspo compare`` sets per run (:data:`FIXED_KEYS`)."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in FIXED_KEYS:
            how = ("starts each run afresh, or reuses it when it finished" if key == "resume"
                   else f"sets {key} itself for each run (seeds: the file's seeds or --seeds; "
                   "folders: --runs)")
            raise ConfigError(f"{where}: '{item}': gspo compare {how}")


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
        if name == "probe":  # its runs would go to probe_s<seed>, the routing probes' folders
            raise ConfigError(f"{where}: arm name 'probe' is taken: gspo compare keeps the "
                              "routing probe of each seed in probe_s<seed>; rename the arm")
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
    p = resolve_path(path, "compare file")  # a file, or a preset name (moe/compare)
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
    probe_arm = all_arms[0]
    spec_seeds = _seeds(data["seeds"], f"{p}: seeds")
    common = _overrides(data.get("overrides"), f"{p}: overrides")
    check_not_fixed(common, f"{p}: overrides")
    for arm in all_arms:
        check_not_fixed(arm.overrides, f"{p}: arms.{arm.name}.overrides")
    # the quick section is checked whether or not --quick is given: a typo in it must not
    # wait for the first --quick run
    q = (None if data.get("quick") is None
         else _mapping(data["quick"], f"{p}: quick", QUICK_KEYS))
    quick_seeds = _seeds(q["seeds"], f"{p}: quick.seeds") if q and "seeds" in q else None
    quick_common = _overrides((q or {}).get("overrides"), f"{p}: quick.overrides")
    check_not_fixed(quick_common, f"{p}: quick.overrides")
    if quick and not q:
        raise ConfigError(f"--quick: {p} has no quick settings (a 'quick:' section with seeds "
                          f"or overrides); run without --quick")
    if arms:
        known = {a.name for a in all_arms}
        for name in arms:
            if name not in known:
                raise ConfigError(f"--arms: no arm '{name}' in {p} (arms: {', '.join(known)})")
        all_arms = [a for a in all_arms if a.name in arms]
    full = CompareSpec(p, base, spec_seeds, common, all_arms, probe_arm)
    fast = CompareSpec(p, base, quick_seeds or spec_seeds, common + quick_common, all_arms,
                       probe_arm)
    # every arm's config builds (and the probe's arm's), with and without the quick settings
    for arm in [probe_arm, *(a for a in all_arms if a is not probe_arm)]:
        full.config(arm, full.seeds[0], "runs")
        if q:
            try:
                fast.config(arm, fast.seeds[0], "runs")
            except ConfigError as e:
                raise ConfigError(f"{p}: with the quick settings: "
                                  f"{str(e).removeprefix(f'{p}: ')}") from None
    spec = fast if quick else full
    if seeds is not None:
        spec = dataclasses.replace(spec, seeds=_seeds(seeds, "--seeds"))
    return spec
