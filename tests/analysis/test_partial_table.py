"""scripts/partial_compare_table.py: one row per run folder, finished or cut short."""

from __future__ import annotations

import gzip
import json
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "partial_compare_table.py"


def _write(folder: Path, rows: list[dict], packed: bool = False) -> None:
    folder.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if packed:
        (folder / "metrics.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    else:
        (folder / "metrics.jsonl").write_text(text)


def test_rows_for_cut_runs_and_probes(tmp_path, capsys):
    step = {"train/loss": 0.1, "objective/clip_frac_tokens": 0.5, "objective/clip_frac_seqs": 0.25,
            "moe/expert_change_after_update": 0.1, "train/grad_norm": 2.0,
            "rollout/response_len_mean": 8.0, "time/rollout_s": 1.0, "time/update_s": 2.0,
            "time/rollout_engine_s": 9.0}
    rows = [{"step": 0, "eval/accuracy": 0.5}]
    rows += [{**step, "step": i + 1, "reward/mean": float(i < 10)} for i in range(25)]
    rows.append({"step": 20, "eval/accuracy": 0.25})
    _write(tmp_path / "runs" / "gspo_s0", rows, packed=True)
    _write(tmp_path / "runs" / "grpo_s0", [{"step": 0, "eval/accuracy": 0.5}])  # no step: no row
    probe = tmp_path / "runs" / "probe_s0"
    probe.mkdir()
    (probe / "compare.json").write_text(json.dumps({
        "expert_change": 0.06, "expert_change_per_layer": [0.02, 0.1], "token_change": 0.2}))
    runpy.run_path(str(SCRIPT), run_name="not_main")["main"]([str(tmp_path)])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| gspo_s0"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:6] == ["25", "50.0% @0 / 25.0% @20", "1.000", "0.000", "0.000"]
    assert cells[6:] == ["0.5000", "0.2500", "10.00%", "10.00%", "2.000", "8.0", "3.00"]
    assert "| grpo_s0" not in out
    assert "| gspo | 1 (25) | 0.500 | 0.250 | 0.400 | 0.000 | 0.5000 |" in out  # per arm
    assert "| probe_s0 | 6.00% | 10.00% (layer 1) | 20.00% |" in out
