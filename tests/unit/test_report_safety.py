"""Safety of what hetsim writes and starts: escaped HTML, JSON only, argument lists, loopback
rendezvous; and the out-of-memory figure that every report carries."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hetsim.strategies.ddp import DDPPlan

from hetsim.execution.runner import Launch
from hetsim.hardware.cluster import Cluster, Device
from hetsim.reporting import report
from hetsim.types import Measurement, MemoryBreakdown, Prediction

ROOT = Path(__file__).resolve().parents[2]
EVIL = "<script>alert('x')</script>"
MiB = 2**20


def _cluster(name: str = "emu0") -> Cluster:
    devs = tuple(Device(name=f"{name}{i}", kind="emu-cpu", memory_bytes=100 * MiB, index=i) for i in range(2))
    return Cluster(spec=f"{name}.toml", source="file", devices=devs)


def _prediction(peaks=(60 * MiB, 80 * MiB)) -> Prediction:
    return Prediction(step_time_s=0.1, samples_per_s=160.0, peak_mem_bytes=peaks,
                      memory=tuple(MemoryBreakdown(params_bytes=p) for p in peaks),
                      capacity_bytes=(100 * MiB, 100 * MiB), feasible=True)


def _data(rows, *, study="s", model="mlp", cluster=None, notes=()) -> report.ReportData:
    return report.ReportData(study=study, model=model, cluster=cluster or _cluster(), global_batch=16,
                             candidates=rows, baseline=None, trials=[{"number": 0, "state": "COMPLETE"}],
                             notes=list(notes))


def test_html_report_escapes_every_name(tmp_path):
    plan = DDPPlan(devices=(0, 1), local_batch=(8, 8))
    failed = Measurement(status="error", error=f"rank 0: RuntimeError: {EVIL}")
    rows = [report.Row(place=1, label=EVIL, plan=plan, predicted=_prediction(), measured=failed)]
    data = _data(rows, study=EVIL, model=EVIL, cluster=_cluster(EVIL), notes=[EVIL])
    folder = report.write(data, tmp_path)
    assert folder.parent == tmp_path / "reports"  # a name with '/' cannot leave the reports folder
    page = (folder / "report.html").read_text()
    assert not re.search(r"<script", page, re.IGNORECASE)
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page  # markupsafe's escape
    assert page.count("&lt;script&gt;") >= 5  # title, heading, cluster, label, error, note


def test_report_folder_name_stays_inside_reports():
    assert report.folder_name("../../etc") == ".._.._etc"
    assert report.folder_name("..") == "_"
    assert report.folder_name("a\nb") == "a_b"
    assert report.folder_name("plain-name.1") == "plain-name.1"


def test_oom_figure_is_in_every_report(tmp_path):
    plan = DDPPlan(devices=(0, 1), local_batch=(8, 8))
    rows = [report.Row(place=1, label="ddp 8/8", plan=plan, predicted=_prediction(), measured=None)]
    folder = report.write(_data(rows), tmp_path)
    for name in ("report.md", "report.html"):
        assert "out-of-memory among 0 executed plans predicted to fit: 0" in (folder / name).read_text()
    assert json.loads((folder / "summary.json").read_text())["accuracy"]["oom_predicted_to_fit"] == 0


def test_oom_predicted_to_fit_shows_plan_and_missing_bytes(tmp_path):
    plan = DDPPlan(devices=(0, 1), local_batch=(6, 10))
    oom = Measurement(status="oom", error="rank 1: out of memory on emu1", failed_rank=1,
                      failed_peak_bytes=101 * MiB)
    ok = Measurement(status="ok", step_time_s=0.1, samples_per_s=160.0, peak_mem_bytes=(50 * MiB, 50 * MiB),
                     memory=(MemoryBreakdown(params_bytes=50 * MiB),) * 2)
    rows = [report.Row(place=1, label="ddp 6/10", plan=plan, predicted=_prediction(), measured=oom),
            report.Row(place=2, label="ddp 8/8", plan=DDPPlan(devices=(0, 1), local_batch=(8, 8)),
                       predicted=_prediction(), measured=ok)]
    folder = report.write(_data(rows), tmp_path)
    acc = json.loads((folder / "summary.json").read_text())["accuracy"]
    assert acc["oom_predicted_to_fit"] == 1 and acc["executed"] == 2
    d = acc["oom_predicted_to_fit_plans"][0]
    assert d["rank"] == 1 and d["device"] == 1 and d["plan"]["local_batch"] == [6, 10]
    assert d["under_predicted_bytes"] == 21 * MiB  # measured 101 MiB, predicted 80 MiB
    md = (folder / "report.md").read_text()
    assert "out-of-memory among 2 executed plans predicted to fit: 1" in md
    assert "Out of memory although predicted to fit" in md and "under-predicted by 21.0 MiB" in md
    assert '"local_batch": [6, 10]' in md
    assert "under-predicted by 21.0 MiB" in (folder / "report.html").read_text()


def test_oom_without_a_measured_peak_gives_a_lower_bound():
    plan = DDPPlan(devices=(0, 1), local_batch=(6, 10))
    row = report.Row(place=1, label="ddp", plan=plan, predicted=_prediction(),
                     measured=Measurement(status="oom", error="CUDA out of memory", failed_rank=0))
    d = report.oom_detail(row)
    assert d["at_least"] and d["under_predicted_bytes"] == 40 * MiB  # capacity 100 - predicted 60
    assert "at least 40.0 MiB" in report.oom_text(d)


def test_local_launch_uses_an_explicit_loopback_rendezvous():
    args = Launch().args(2)
    assert "--standalone" not in args
    assert args[args.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"
    assert args[args.index("--local-addr") + 1] == "127.0.0.1"
    remote = Launch(nnodes="2", rdzv_endpoint="node0:29500", node_rank=1).args(2)
    assert "--local-addr" not in remote and remote[remote.index("--rdzv-endpoint") + 1] == "node0:29500"


def test_no_pickle_and_no_shell_strings():
    """Profiles, plans and results are JSON; processes are started from argument lists."""
    banned = [r"\bimport pickle\b", r"\bpickle\.", r"torch\.load\(", r"shell\s*=\s*True", r"os\.system\(",
              r"os\.popen\(", r"yaml\.load\("]
    for folder in ("hetsim", "search", "strategies"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            for pat in banned:
                assert not re.search(pat, text), f"{path.relative_to(ROOT)} matches {pat}"


def test_sequence_models_show_tokens_per_second():
    plan = DDPPlan(devices=(0, 1), local_batch=(8, 8))
    meas = Measurement(status="ok", step_time_s=0.2, samples_per_s=80.0, peak_mem_bytes=(60 * MiB, 80 * MiB))
    row = report.Row(place=1, label="ddp", plan=plan, predicted=_prediction(), measured=meas)
    plain = _data([row])
    assert "pred tokens/s" not in report.header(plain)
    tokens = _data([row])
    tokens.tokens_per_sample = 64
    head = report.header(tokens)
    cells = dict(zip(head, report.table_rows(tokens)[0]))
    assert cells["pred tokens/s"] == f"{160.0 * 64:.0f}" and cells["meas tokens/s"] == f"{80.0 * 64:.0f}"
    assert len(head) == len(report.table_rows(tokens)[0])
    assert report.summary(tokens)["tokens_per_sample"] == 64
