"""The YAML presets shipped inside the package, found by name from any directory.

``gspo train tiny_cpu`` and ``gspo compare moe/compare`` name files of this folder (the
``.yaml`` is optional); a path that exists is always read as a path first, so a local file
shadows a preset of the same name. In a clone, ``configs/`` is a link to this folder, so
``configs/tiny_cpu.yaml`` keeps working there (and elsewhere it is read as the preset
``tiny_cpu``). Each preset opens with a comment whose first sentence ``gspo presets`` lists.

Standard library only: :mod:`gspo.config` resolves names through it (``read_yaml``,
``resolve_path``), so ``load_config("tiny_cpu")`` works from Python too.
"""

from __future__ import annotations

import re
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
SUFFIXES = (".yaml", ".yml")
SUMMARY_CHARS = 110  # longest summary `gspo presets` prints on one line


def preset_files() -> list[Path]:
    """Every preset file, sorted by name (sub-folders included)."""
    return sorted((p for p in FOLDER.rglob("*") if p.suffix in SUFFIXES and p.is_file()),
                  key=preset_name)


def preset_name(path: Path) -> str:
    """``moe/compare`` for ``<presets>/moe/compare.yaml``."""
    return path.relative_to(FOLDER).with_suffix("").as_posix()


def names() -> list[str]:
    return [preset_name(p) for p in preset_files()]


def find_preset(name: str) -> Path | None:
    """The preset file called ``name`` (``tiny_cpu``, ``moe/compare.yaml``,
    ``configs/tiny_cpu.yaml``), or None."""
    key = name.replace("\\", "/")
    key = key.removeprefix("./").removeprefix("configs/").removeprefix("gspo/presets/")
    for suffix in SUFFIXES:
        key = key.removesuffix(suffix)
    for p in preset_files():
        if preset_name(p) == key:
            return p
    return None


def hint() -> str:
    """The tail of a "not found" message: which presets exist."""
    return f"presets: {', '.join(names())}; see `gspo presets`"


def summary(path: Path) -> str:
    """The first sentence of the file's leading comment, shortened to one line."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text or text.startswith(("gspo ", "python ")):  # the command lines end it
            break
        lines.append(text)
    text = " ".join(lines)
    m = re.search(r"^(.+?[.!?])(\s+[A-Z`(]|$)", text)  # not "Sec. 5.3" or "e.g. x"
    text = m.group(1) if m else text
    if len(text) > SUMMARY_CHARS:
        text = text[:SUMMARY_CHARS - 3].rsplit(" ", 1)[0] + "..."
    return text or "(no description)"


def listing() -> str:
    """One line per preset: its name and its summary."""
    files = preset_files()
    width = max((len(preset_name(p)) for p in files), default=0)
    return "\n".join(f"{preset_name(p):<{width}}  {summary(p)}" for p in files)
