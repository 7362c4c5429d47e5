"""Checks of the CLI's values that are cheap enough to run before anything is measured.

Each raises ConfigError naming the value, the rule and a fix; the CLI prints it
as one line and exits with code 2.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
from pathlib import Path

from hetsim.errors import ConfigError, UnknownNameError

from .golden import RESULTS
from .options import DEFAULT_OUT


def closest_hint(name: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else ""


def name_list(text: str, option: str, known: list[str] | tuple[str, ...], what: str) -> tuple[str, ...]:
    """'ddp, pipeline' -> ('ddp', 'pipeline'), every item checked against `known`."""
    items = tuple(s.strip() for s in text.split(","))
    if not any(items):
        raise ConfigError(f"{option} {text!r} names nothing; give comma-separated {what}s from {', '.join(known)}")
    for s in items:
        if not s:
            raise ConfigError(f"{option} {text!r} has an empty item; write comma-separated names such as "
                              f"{','.join(list(known)[:2])}")
        if s not in known:
            raise UnknownNameError(what, s, known, closest_hint(s, known))
    return tuple(dict.fromkeys(items))


_RESERVED_NAMES = {".", ".."}


def study_name(name: str) -> str:
    """A study name is also a folder name under OUT/reports and OUT/runs."""
    if not name.strip():
        raise ConfigError("--study '' is empty; give a name such as my-study (it names the report folder)")
    bad = sorted({c for c in name if c in "/\\" or unicodedata.category(c).startswith("C")})
    if bad or name in _RESERVED_NAMES:
        shown = ", ".join(repr(c) for c in bad) if bad else repr(name)
        raise ConfigError(f"--study {name!r} cannot name a folder (it contains {shown}); the study name becomes "
                          f"OUT/reports/NAME, so use letters, digits and - _ . such as "
                          f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name).strip('._') or 'my-study'!r}")
    if len(name) > 200:
        raise ConfigError(f"--study name is {len(name)} characters long; the limit is 200 (it names a folder)")
    return name


def nnodes(text: str) -> int:
    """torchrun's --nnodes: N or MIN:MAX; returns the largest node count."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or lo < 1 or hi < lo:
        raise ConfigError(f"--nnodes {text!r} is not a node count; write N (e.g. 2) or MIN:MAX (e.g. 1:4) with "
                          "1 <= MIN <= MAX")
    return hi


def rdzv_endpoint(text: str) -> str:
    """HOST:PORT, with [::1]:PORT for IPv6 addresses."""
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d+)", text.strip())
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ConfigError(f"--rdzv-endpoint {text!r} is not HOST:PORT with a port from 1 to 65535; "
                          "e.g. node0.example.org:29500 (the first node listens there)")
    return text.strip()


def node_rank(rank: int | None, max_nodes: int) -> None:
    if rank is not None and not 0 <= rank < max_nodes:
        raise ConfigError(f"--node-rank {rank} is outside 0..{max_nodes - 1} for --nnodes {max_nodes}; number the "
                          "nodes from 0")


def batch_covers_devices(global_batch: int, n_devices: int, min_local: int, has_batchnorm: bool,
                         model: str) -> None:
    """The uniform data-parallel baseline runs on every device with at least one sample each
    (two with BatchNorm, which needs more than one value per channel)."""
    per = max(min_local, 2 if has_batchnorm else 1)
    need = per * n_devices
    if global_batch < need:
        why = (f"{model} has BatchNorm, which needs 2 samples per device" if has_batchnorm and per == 2
               else f"--min-local-batch {min_local}")
        raise ConfigError(f"--global-batch {global_batch} is smaller than the {need} samples the cluster's "
                          f"{n_devices} devices need ({per} each: {why}); raise --global-batch to at least "
                          f"{need} or use fewer devices")


def image_fits(image_size: int, model: str, largest_device_bytes: int) -> None:
    """One fp32 input sample must fit on the largest device before anything else can."""
    sample = 3 * image_size * image_size * 4
    if sample > largest_device_bytes:
        raise ConfigError(f"--image-size {image_size}: one 3x{image_size}x{image_size} fp32 input to {model} "
                          f"alone is {sample / 2**30:.1f} GiB, more than the largest device "
                          f"({largest_device_bytes / 2**30:.1f} GiB); use a smaller --image-size")


def seed(value: int) -> int:
    if not 0 <= value < 2**32:
        raise ConfigError(f"--seed {value} is outside 0..{2**32 - 1} (numpy's seed range); pick e.g. 0")
    return value


def not_the_recordings(out: Path, option: str) -> None:
    """A run writes its profiles, study and reports under `out`, so `out` must not be the folder of
    committed recordings (results/ of a checkout: profiles, golden files, bench runs), which the
    regression tests and the bench read as they were recorded."""
    if out.resolve() == RESULTS.resolve() or (out / "golden").is_dir():
        raise ConfigError(f"{option} {str(out)!r} is a folder of committed recordings (profiles, golden files, "
                          f"bench runs), which a run never writes; leave {option} out (default {DEFAULT_OUT}) "
                          "or choose another folder")


def output_folder(text: str, option: str) -> Path:
    """The run's output folder, created: not the committed recordings, and writable."""
    out = Path(text)
    not_the_recordings(out, option)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{option} {text!r} is not a writable folder ({e.strerror}); choose another") from None
    return out
