"""A found plan as a file: what `hetsim.search.train` needs to train with it, and what it was measured at.

The search writes `best_plan.json` (and one file per executed candidate) beside its report;
`python -m hetsim.search.train --plan best_plan.json` reads it back.  The file names the cluster and the
workload it was found for, so a plan is never applied to another cluster or model by mistake.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hetsim.errors import ConfigError
from hetsim.serial import dump_json, from_dict

FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class PlanFile:
    """One plan, with the context it was found and measured in."""

    format: int = FORMAT
    plan: dict
    """The plan as `hetsim.serial.to_dict` writes it (its `strategy` field names the family)."""
    label: str = ""
    cluster_spec: str
    """The `--cluster` text the plan was found for."""
    devices: tuple[dict, ...]
    """The plan's devices in rank order (emulated speed and memory cap, or the GPU)."""
    workload: str
    """The workload spec the plan was found for ('resnet18@128', 'gpt@tiny', 'pkg.mod:fn')."""
    optimizer: str = "adamw"
    global_batch: int
    predicted_samples_per_s: float = 0.0
    predicted_step_time_s: float = 0.0
    measured_samples_per_s: float | None = None
    """What the search measured for this plan (raw), None when it was not executed."""
    measured_at_ref_samples_per_s: float | None = None
    """The same at the profiles' host speed (emulated clusters), as the report compares it."""
    ref_probe_s: float = 0.0
    """The profiles' host-speed probe (0 when none)."""
    study: str = ""

    @property
    def world_size(self) -> int:
        return len(self.devices)


def save_plan_file(pf: PlanFile, path: Path) -> Path:
    dump_json(pf, path)
    return path


def load_plan_file(path: str | Path) -> PlanFile:
    """Read a plan file; a missing, unreadable or foreign file is a ConfigError naming the fix."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--plan {str(path)!r}: no such file; pass the best_plan.json a search wrote "
                          "(its path is printed at the end of `python -m hetsim.search`)")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--plan {str(path)!r}: not a readable JSON plan file ({e}); "
                          "pass the best_plan.json a search wrote") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "plan" not in data:
        raise ConfigError(f"--plan {str(path)!r}: not a hetsim plan file (format {FORMAT} with a 'plan' field); "
                          "pass the best_plan.json a search wrote")
    try:
        return from_dict(PlanFile, data)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"--plan {str(path)!r}: damaged plan file ({e}); run the search again") from None
