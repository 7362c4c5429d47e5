"""What-if accuracy and speed: the roofline against published single-GPU training throughput, and the
seconds a catalog question takes before the search (trace + profiles, nothing timed on the CPU).

Writes nothing under results/: the numbers go to the benchmark's extra_info (pytest-benchmark saves
them with the run) and a copy to results/local/whatif.json."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench_config import RESULTS


def test_whatif_accuracy(benchmark):
    from hetsim.reporting import whatif

    checked = benchmark.pedantic(whatif.validate, rounds=1, iterations=1)
    held = [c for c in checked if not whatif.fitted(c.row)]
    info = {
        "rows": len(checked),
        "median_abs_error": whatif.median_abs_error(checked),
        "held_out_median_abs_error": whatif.median_abs_error(held),
        "order_violations": whatif.order_violations(checked),
        "per_source": {src: {"rows": len(part), "median_abs_error": whatif.median_abs_error(part),
                             "order_violations": whatif.order_violations(part)}
                       for src, part in whatif.by_source(checked).items()},
        "per_row": [{"model": c.row.model, "gpu": c.row.gpu, "precision": c.row.precision, "batch": c.row.batch,
                     "published": c.row.samples_per_s, "predicted": round(c.predicted, 1),
                     "error": round(c.error, 4), "source": c.row.source} for c in checked],
    }
    benchmark.extra_info.update(info)
    out = RESULTS / "local"
    out.mkdir(parents=True, exist_ok=True)
    Path(out / "whatif.json").write_text(json.dumps(info, indent=1))
    assert info["median_abs_error"] <= 0.20


def test_catalog_profiles_seconds(benchmark):
    """A catalog question in fp16 at 224 px: trace and roofline profiles (the part that used to profile
    the whole model on the CPU for 13+ minutes)."""
    from hetsim.search.profiles import catalog_profiles

    from hetsim.hardware.cluster import parse_cluster
    from hetsim.workloads.builtin import load_workload

    wl = load_workload("resnet50", 224)
    cluster = parse_cluster("catalog:v100_sxm2_16gb,a100_sxm_80gb,h100_sxm")
    t0 = time.perf_counter()
    profs = benchmark.pedantic(lambda: catalog_profiles(cluster, wl, (2, 128, 256), ("fp32", "fp16"), lambda m: None),
                               rounds=1, iterations=1)
    benchmark.extra_info["seconds"] = time.perf_counter() - t0
    assert set(profs) == {"v100_sxm2_16gb", "a100_sxm_80gb", "h100_sxm"}
