"""The roofline's what-if predictions against published single-GPU training throughput.

`hetsim/data/published_throughput.csv` lists what others measured (sources in
`published_sources.csv`); `validate()` predicts every row from code (a meta-device trace of the model
and the catalog's datasheet figures) and reports each error, the median absolute error and whether
the GPUs come out in the published order.  `python -m hetsim.reporting.whatif` prints the table;
`--fit` repeats the grid search that chose `hetsim.model.roofline.EFFICIENCY` (the rows `fitted` says).
"""

from __future__ import annotations

import csv
import functools
import statistics
import sys
from dataclasses import dataclass, replace
from importlib import resources

from hetsim.hardware.cluster import catalog_device, load_catalog
from hetsim.model.roofline import EFFICIENCY, Efficiency, ModelShapes, clock_factor, throughput

FIT_GPUS = frozenset({"quadro_rtx_8000", "v100_sxm2_16gb", "rtx_3090", "a100_sxm_80gb", "rtx_4090", "h100_pcie"})
"""The GPUs whose published rows (both models, both precisions) fit `EFFICIENCY`; every other row
is held out and only validates."""
HELD_OUT_SOURCES = frozenset({"L22", "L24"})
"""Sources held out whole, whatever the GPU: Lambda's 2022 tables (an older container, NGC 21.07) came
after the fit and validate it on the users' own older GPUs (GTX 1080 Ti, RTX 2080 Ti) and on a second
software version of the fit GPUs; Lambda's v2 tables (L24: H100 PCIe, H100 SXM, H200) were collected
after the fit too and were first predicted blind (README, "Lambda's v2 tables")."""
BERT_LARGE = dict(causal=False, vocab_size=30522, d_model=1024, n_layer=24, n_head=16)


@dataclass(frozen=True, slots=True)
class Published:
    model: str
    gpu: str
    published_gpu: str
    precision: str
    published_math: str
    optimizer: str
    batch: int
    samples_per_s: float
    source: str


@dataclass(frozen=True, slots=True)
class Checked:
    row: Published
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.row.samples_per_s - 1.0


def fitted(row: Published) -> bool:
    """Whether a published row is one `EFFICIENCY` was fitted on (`--fit`); the others only validate."""
    return row.gpu in FIT_GPUS and row.source not in HELD_OUT_SOURCES


def by_source(checked: list[Checked]) -> dict[str, list[Checked]]:
    """The checked rows per source, in the table's order."""
    out: dict[str, list[Checked]] = {}
    for c in checked:
        out.setdefault(c.row.source, []).append(c)
    return out


def published_rows() -> list[Published]:
    text = resources.files("hetsim").joinpath("data/published_throughput.csv").read_text()
    return [Published(model=r["model"], gpu=r["gpu"], published_gpu=r["published_gpu"], precision=r["precision"],
                      published_math=r["published_math"], optimizer=r["optimizer"], batch=int(r["batch"]),
                      samples_per_s=float(r["samples_per_s"]), source=r["source"])
            for r in csv.DictReader(text.splitlines())]


def bert_squad_workload(seq_len: int = 384):
    """BERT-large for SQuAD: the GPT block structure without causal masking, with a 2-logit span head
    in place of the vocabulary projection (what the published fine-tuning runs train)."""
    import torch
    from torch import nn

    from hetsim.workloads.builtin import Workload
    from hetsim.workloads.transformer import GPTConfig, gpt_blocks, token_batch

    cfg = GPTConfig(seq_len=seq_len, **BERT_LARGE)

    def build():
        torch.manual_seed(0)
        return gpt_blocks(cfg)[:-1] + [("head", nn.Sequential(nn.LayerNorm(cfg.d_model), nn.Linear(cfg.d_model, 2)))]

    return Workload(name="bert-large-squad", build_blocks=build, make_batch=token_batch(cfg),
                    spec=f"bert-large-squad@{seq_len}")


@functools.cache
def model_shapes(model: str) -> ModelShapes:
    from hetsim.profiling.shapes import trace
    from hetsim.workloads.builtin import load_workload

    name, _, size = model.partition("@")
    if name == "bert-large-squad":
        return trace(bert_squad_workload(int(size)))
    return trace(load_workload(name, int(size)))


def predict(row: Published, eff: Efficiency = EFFICIENCY) -> float:
    dev = catalog_device(load_catalog()[row.gpu], 0)
    opt = "fused" if row.optimizer == "fused_adam" else row.optimizer
    return throughput(model_shapes(row.model), dev, row.batch, row.precision, opt, eff,
                      matmul_tf32=row.published_math == "tf32")


def validate(rows: list[Published] | None = None, eff: Efficiency = EFFICIENCY) -> list[Checked]:
    return [Checked(r, predict(r, eff)) for r in (rows if rows is not None else published_rows())]


def median_abs_error(checked: list[Checked]) -> float:
    return statistics.median(abs(c.error) for c in checked)


ROUNDING = 1.0
"""Published figures are whole samples per second: two that differ by 1 may be one throughput rounded
apart (BERT-large at 10 and 11 sequences/s), so they are a tie whatever `tie` says."""


def _ordered_pairs(checked: list[Checked], tie: float):
    """(a, b) for every pair of GPUs (same model, precision and source) that the published figures
    order: more than `tie` and more than `ROUNDING` apart."""
    for a in checked:
        for b in checked:
            ra, rb = a.row, b.row
            if (ra.model, ra.precision, ra.source) != (rb.model, rb.precision, rb.source) or ra.gpu >= rb.gpu:
                continue
            if abs(ra.samples_per_s / rb.samples_per_s - 1) <= tie or abs(ra.samples_per_s - rb.samples_per_s) <= ROUNDING:
                continue
            yield a, b


def _in_order(a: Checked, b: Checked) -> bool:
    return (a.row.samples_per_s > b.row.samples_per_s) == (a.predicted > b.predicted)


def order_violations(checked: list[Checked], tie: float = 0.05) -> list[str]:
    """Pairs of GPUs (same model, precision and source) whose predicted order contradicts the
    published one; published figures within `tie` (or `ROUNDING`) of each other are a tie and never
    violated."""
    return [f"{a.row.model} {a.row.precision}: {a.row.gpu} vs {b.row.gpu}"
            for a, b in _ordered_pairs(checked, tie) if not _in_order(a, b)]


def order_agreement(checked: list[Checked], tie: float = 0.05) -> tuple[int, int]:
    """(pairs predicted in the published order, pairs the published figures order)."""
    pairs = list(_ordered_pairs(checked, tie))
    return sum(_in_order(a, b) for a, b in pairs), len(pairs)


GRID = (0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)


def _row_arrays(row: Published):
    """Per operator of the row's step, at unit efficiency: (tensor-core seconds, CUDA-core seconds,
    fixed-byte seconds, per-sample-byte seconds, 1 where Winograd applies), and the optimizer step
    (what `throughput` adds)."""
    import numpy as np

    from hetsim.model.roofline import math_rate

    shapes = model_shapes(row.model)
    dev = catalog_device(load_catalog()[row.gpu], 0)
    cols = []
    for o in (o for b in shapes.blocks for o in b.fwd + b.bwd):
        tens = simt = 0.0 if o.kind == "mem" or o.flops_per_sample <= 0 else float("inf")
        if o.kind != "mem" and o.flops_per_sample > 0:
            peak, unit = math_rate(dev, o.kind, row.precision, row.published_math == "tf32")
            flops = o.flops_per_sample * row.batch
            if unit != "simt":
                tens = flops / peak
                simt = flops / dev.peak_fp32_flops if unit == "tensor" and row.precision == "fp32" else float("inf")
            else:
                simt = flops / peak
        cols.append((tens, simt, o.bytes_fixed / dev.mem_bw_bps, o.bytes_per_sample * row.batch / dev.mem_bw_bps,
                     float(o.kind == "conv3x3")))
    opt = "fused" if row.optimizer == "fused_adam" else row.optimizer
    return np.array(cols), (opt, shapes, dev)


WINOGRADS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
"""Winograd gains tried: from none to F(4x4,3x3)'s 4x fewer multiplications, its arithmetic bound."""


TURINGS = (1.0, 0.9, 0.8, 0.7, 0.6)
"""Turing tensor shares tried (`Efficiency.turing`), from the other generations' share down."""


LOOP_OPS = (5e-6, 10e-6, 15e-6, 20e-6, 30e-6)
"""Dispatch floors tried for BertAdam's operators (`Efficiency.loop_op_s`): from a fast host's eager
PyTorch to the fit's per-operator floor of forward and backward."""


SM_BYTES = (0.0, 6.0, 7.0, 8.0, 9.0, 10.0, 12.0)
"""Per-SM streaming caps tried (`Efficiency.sm_bytes`, bytes per SM per boost cycle): none, and from
where every HBM GPU of the fit would be capped to where none is."""


def fit(rows: list[Published], grid=GRID, lows=(0.5, 0.6, 0.7, 0.8), clocks=(0.0, 0.25, 0.5, 0.75, 1.0),
        winograds=WINOGRADS, turings=TURINGS, loop_ops=LOOP_OPS, sm_bytes=SM_BYTES) -> Efficiency:
    """The (tensor, simt, mem, low_bytes, clock, winograd, turing, loop_op_s, sm_bytes) efficiencies on the
    grid with the least root-mean-square log error (predicted over published throughput) over rows: least
    squares on log throughput, so every row counts and a row 20 % slow weighs what a row 20 % fast does.
    The sums are those of `hetsim.model.roofline.throughput`, vectorised per row over the SM caps and the
    tensor and CUDA-core grids; the optimizer step is added per cap and BertAdam floor (memoised: it
    depends on them only through the memory rate); ties go to the first set in grid order."""
    import itertools

    import numpy as np

    from hetsim.model.roofline import generation_factor, mem_rate, optimizer_s, tensor_share

    arrays = [_row_arrays(r) for r in rows]
    pub = np.array([r.samples_per_s for r in rows])
    g = np.array(grid)
    tv = np.array(turings)
    opt_memo: dict[tuple, float] = {}
    best = None
    for m, low, clk, wino in itertools.product(grid, lows, clocks, winograds):
        eff = replace(EFFICIENCY, mem=m, low_bytes=low, clock=clk, winograd=wino)
        # floor, cap, row, turing, tensor, simt
        pred = np.empty((len(loop_ops), len(sm_bytes), len(rows), len(tv), len(g), len(g)))
        for i, (r, (a, (opt, shapes, dev))) in enumerate(zip(rows, arrays, strict=True)):
            caps = [replace(eff, sm_bytes=k) for k in sm_bytes]
            rel = np.array([mem_rate(dev, c) / dev.mem_bw_bps for c in caps])  # the cap's share of the bandwidth
            tb = (a[:, 2] + a[:, 3] * (low if r.precision != "fp32" else 1.0))[None, :] / rel[:, None]
            simt = a[:, 1] / np.where(a[:, 4] > 0, wino, 1.0)
            gen = np.array([generation_factor(dev, replace(eff, turing=t)) for t in turings])
            share = tensor_share(g, dev.tensor_feed)[None, :] * gen[:, None]
            tm = np.minimum(a[None, None, None, :, 0] / share[:, :, None, None],
                            simt[None, None, None, :] / g[None, None, :, None])
            tm = tm / clock_factor(dev, eff)
            passes = np.maximum(np.maximum(tm[None], tb[:, None, None, None, :]), eff.launch_s).sum(axis=4)
            for j, c in enumerate(caps):
                for k, floor in enumerate(loop_ops):
                    key = (i, float(rel[j]), floor if opt == "bert_adam" else 0.0)
                    if key not in opt_memo:
                        opt_memo[key] = optimizer_s(shapes, dev, opt, replace(c, loop_op_s=floor))
                    pred[k, j, i] = r.batch / (passes[j] + opt_memo[key])
        err = np.sqrt(np.mean(np.log(pred / pub[None, None, :, None, None, None]) ** 2, axis=2))
        ki, ci, ui, ti, si = np.unravel_index(int(np.argmin(err)), err.shape)
        if best is None or err[ki, ci, ui, ti, si] < best[0]:
            best = (float(err[ki, ci, ui, ti, si]),
                    replace(eff, tensor=float(g[ti]), simt=float(g[si]), turing=float(tv[ui]),
                            loop_op_s=float(loop_ops[ki]), sm_bytes=float(sm_bytes[ci])))
    return best[1]


def table(checked: list[Checked]) -> str:
    lines = ["| model | GPU | precision | batch | published | predicted | error | source |", "|---|---|---|---|---|---|---|---|"]
    for c in checked:
        r = c.row
        lines.append(f"| {r.model} | {r.gpu} | {r.precision} | {r.batch} | {r.samples_per_s:g} | {c.predicted:.0f} | "
                     f"{c.error:+.0%} | {r.source} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    rows = published_rows()
    eff = EFFICIENCY
    if "--fit" in argv:
        eff = fit([r for r in rows if fitted(r)])
        print(f"fitted on the rows of {sorted(FIT_GPUS)} (not of {sorted(HELD_OUT_SOURCES)}): {eff}")
    checked = validate(rows, eff)
    print(table(checked))
    for label, part in (("all", checked), ("resnet50", [c for c in checked if c.row.model.startswith("resnet50")]),
                        ("bert", [c for c in checked if c.row.model.startswith("bert")]),
                        ("fitted rows", [c for c in checked if fitted(c.row)]),
                        ("held-out rows", [c for c in checked if not fitted(c.row)]),
                        *((f"source {s}", part) for s, part in by_source(checked).items())):
        good, pairs = order_agreement(part)
        print(f"{label}: median |error| {median_abs_error(part):.1%} over {len(part)} rows; "
              f"order violations {pairs - good} of {pairs} ordered pairs")
    for v in order_violations(checked):
        print("  order:", v)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
