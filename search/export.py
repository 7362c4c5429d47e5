"""What a search leaves behind to train with its plans: `best_plan.json`, one file per executed
candidate, and `launch.sh` with the exact torchrun command (as DeepSpeed's autotuner leaves its
best config and command)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from hetsim.execution.planfile import PlanFile, save_plan_file
from hetsim.execution.runner import Launch, device_dicts
from hetsim.hardware.cluster import Cluster
from hetsim.reporting.report import Row
from hetsim.serial import to_dict

TRAIN_STEPS = 30
"""Steps `launch.sh` trains by default (pass --steps or --epochs to change it)."""


def plan_file(row: Row, *, cluster: Cluster, workload: str, optimizer: str, study: str) -> PlanFile:
    m = row.measured
    ok = m is not None and m.timed
    at_ref = m.step_time_at(row.ref_probe_s) if ok else None
    gb = row.plan.global_batch
    return PlanFile(plan=to_dict(row.plan), label=row.label, cluster_spec=cluster.spec,
                    devices=device_dicts(cluster, row.plan.devices), workload=workload, optimizer=optimizer,
                    global_batch=gb, predicted_samples_per_s=row.predicted.samples_per_s,
                    predicted_step_time_s=row.predicted.step_time_s,
                    measured_samples_per_s=m.samples_per_s if ok else None,
                    measured_at_ref_samples_per_s=gb / at_ref if at_ref else None,
                    ref_probe_s=row.ref_probe_s, study=study)


def timed_rows(rows: list[Row]) -> list[Row]:
    """The rows whose real run gave a step time."""
    return [r for r in rows if r.measured is not None and r.measured.timed]


def best_row(rows: list[Row]) -> Row | None:
    """The best measured plan (at the profiles' host speed), else the best predicted one."""
    measured = timed_rows(rows)
    if measured:
        return min(measured, key=lambda r: r.measured.step_time_at(r.ref_probe_s) / r.plan.global_batch)
    feasible = [r for r in rows if r.predicted.feasible]
    return max(feasible, key=lambda r: r.predicted.samples_per_s) if feasible else None


def torchrun_lines(plan_path: Path, pf: PlanFile, launch: Launch) -> list[str]:
    """One torchrun command per node (one node unless the search was given a rendezvous endpoint)."""
    train = ["-m", "hetsim.search.train", "--plan", str(plan_path.resolve()), "--model", pf.workload,
             "--steps", str(TRAIN_STEPS)]
    n = pf.world_size
    # torchrun's own (empty) log folders beside the plan, not one more /tmp/torchelastic_* a training run.
    logs = ["--log-dir", str(plan_path.resolve().parent / "torchelastic")]
    if launch.rdzv_endpoint:
        nnodes = int(launch.nnodes.split(":")[-1])
        per = -(-n // nnodes)
        return [shlex.join(["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(per), "--node-rank",
                            str(k), "--rdzv-backend", launch.rdzv_backend, "--rdzv-endpoint", launch.rdzv_endpoint,
                            "--rdzv-id", launch.rdzv_id, *logs, *train]) + ' "$@"' for k in range(nnodes)]
    # One machine: torchrun through hetsim's launcher, which binds torchrun's stores to loopback
    # (plain `torchrun --standalone` would listen on every interface); the arguments are torchrun's.
    return [shlex.join([sys.executable, "-m", "hetsim.execution.launcher", "--nnodes", "1", "--nproc-per-node", str(n),
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", "hetsim-train",
                        "--local-addr", "127.0.0.1", *logs, *train]) + ' "$@"']


def write_launch_script(folder: Path, plan_path: Path, pf: PlanFile, launch: Launch) -> Path:
    lines = torchrun_lines(plan_path, pf, launch)
    root = Path(__file__).resolve().parents[1]
    body = [
        "#!/usr/bin/env bash",
        f"# Train with the best plan of study {pf.study!r}: {pf.label}",
        f"# predicted {pf.predicted_samples_per_s:.1f} samples/s"
        + (f", measured {pf.measured_samples_per_s:.1f} samples/s by the search" if pf.measured_samples_per_s else ""),
        "# Extra arguments go to hetsim.search.train (e.g. --data pkg.mod:fn --epochs 3 --checkpoint-dir ckpt).",
        "set -euo pipefail",
        f'export PYTHONPATH="{root}${{PYTHONPATH:+:$PYTHONPATH}}"',
        f'PATH="{Path(sys.executable).parent}:$PATH"',
    ]
    check = shlex.join([sys.executable, "-m", "hetsim.search.train", "--check", "--plan", str(plan_path.resolve()),
                        "--model", pf.workload]) + ' "$@" >/dev/null'
    body.append("# Check the inputs first: bad input is one line and exit 2, before any rank starts.")
    body.append(check)
    if len(lines) == 1:
        body.append("exec " + lines[0])
    else:
        body.append("# One line per node: run line k on node k (NODE_RANK=k bash launch.sh).")
        body.append('case "${NODE_RANK:-0}" in')
        body += [f"  {k}) exec {line} ;;" for k, line in enumerate(lines)]
        body.append("esac")
    path = folder / "launch.sh"
    path.write_text("\n".join(body) + "\n")
    path.chmod(0o755)
    return path


def export_plans(folder: Path, rows: list[Row], *, cluster: Cluster, workload: str, optimizer: str, study: str,
                 launch: Launch) -> Path | None:
    """Write plans/<k>.json for every candidate, best_plan.json and launch.sh; the launch script's path."""
    best = best_row(rows)
    if best is None:
        return None
    (folder / "plans").mkdir(parents=True, exist_ok=True)
    for r in rows:
        name = "baseline" if r.place == 0 else f"candidate-{r.place}"
        save_plan_file(plan_file(r, cluster=cluster, workload=workload, optimizer=optimizer, study=study),
                       folder / "plans" / f"{name}.json")
    pf = plan_file(best, cluster=cluster, workload=workload, optimizer=optimizer, study=study)
    path = save_plan_file(pf, folder / "best_plan.json")
    return write_launch_script(folder, path, pf, launch)
