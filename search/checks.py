"""Checks of the CLI's values that are cheap enough to run before anything is measured.

Each raises ConfigError naming the value, the rule and a fix; the CLI prints it
as one line and exits with code 2.
"""

from __future__ import annotations

import difflib
import re
import unicodedata
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from hetsim.errors import ConfigError, UnknownNameError, shown
from hetsim.hardware.devices import host_memory_bytes
from hetsim.names import BN_MIN_SAMPLES, min_samples_per_micro_batch

if TYPE_CHECKING:  # a type only: the footprint module imports torch, and these checks run before it
    from hetsim.workloads.footprint import SampleFootprint

from .options import DEFAULT_OUT, RESULTS


def closest_hint(name: str, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else ""


def name_list(text: str, option: str, known: list[str] | tuple[str, ...], what: str) -> tuple[str, ...]:
    """'ddp, pipeline' -> ('ddp', 'pipeline'), every item checked against `known`."""
    items = tuple(s.strip() for s in text.split(","))
    if not any(items):
        raise ConfigError(f"{option} {shown(text)} names nothing; give comma-separated {what}s from {', '.join(known)}")
    for s in items:
        if not s:
            raise ConfigError(f"{option} {shown(text)} has an empty item; write comma-separated names such as "
                              f"{','.join(list(known)[:2])}")
        if s not in known:
            raise UnknownNameError(what, s, known, closest_hint(s, known))
    return tuple(dict.fromkeys(items))


_RESERVED_NAMES = {".", ".."}
MAX_NODES = 1024
"""torchrun nodes: at least one device each, and a cluster holds at most 1,024 devices."""


def study_name(name: str) -> str:
    """A study name is also a folder name under OUT/reports and OUT/runs."""
    if not name.strip():
        raise ConfigError("--study '' is empty; give a name such as my-study (it names the report folder)")
    bad = sorted({c for c in name if c in "/\\" or unicodedata.category(c).startswith("C")})
    if bad or name in _RESERVED_NAMES:
        found = ", ".join(repr(c) for c in bad[:5]) if bad else repr(name)
        raise ConfigError(f"--study {shown(name)} cannot name a folder (it contains {found}); the study name becomes "
                          f"OUT/reports/NAME, so use letters, digits and - _ . such as "
                          f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name).strip('._') or 'my-study'!r}")
    size = len(name.encode("utf-8", "surrogateescape"))
    if size > 200:
        raise ConfigError(f"--study name is {size} bytes long; the limit is 200 (it names a folder, and file "
                          "systems allow 255 bytes per name)")
    return name


def nnodes(text: str) -> int:
    """torchrun's --nnodes: N or MIN:MAX; returns the largest node count."""
    m = re.fullmatch(r"\s*([0-9]{1,9})\s*(?::\s*([0-9]{1,9})\s*)?", text)
    lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or lo < 1 or hi < lo:
        raise ConfigError(f"--nnodes {shown(text)} is not a node count; write N (e.g. 2) or MIN:MAX (e.g. 1:4) "
                          "with 1 <= MIN <= MAX")
    if hi > MAX_NODES:
        raise ConfigError(f"--nnodes {shown(text)} is above the limit of {MAX_NODES} nodes (a cluster holds at most "
                          f"{MAX_NODES} devices); use fewer nodes")
    return hi


def rdzv_endpoint(text: str) -> str:
    """HOST:PORT, with [::1]:PORT for IPv6 addresses."""
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253}):([0-9]{1,5})", text.strip())
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise ConfigError(f"--rdzv-endpoint {shown(text)} is not HOST:PORT with a port from 1 to 65535; "
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
    per = min_samples_per_micro_batch(has_batchnorm, min_local)
    need = per * n_devices
    if global_batch < need:
        why = (f"{model} has BatchNorm, which needs {BN_MIN_SAMPLES} samples per device"
               if has_batchnorm and per == BN_MIN_SAMPLES
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


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def batch_fits_memory(global_batch: int, sample: SampleFootprint, model: str, device_bytes: list[int],
                      profiler_bytes: int, profiler_where: str) -> None:
    """Two floors, cheap enough to check before anything is measured.  A global batch whose inputs
    alone exceed the memory of the whole cluster can never run.  And the profiler measures, on
    `profiler_where`, micro-batches up to the largest share one device may take (the global batch
    less one sample per other device): their inputs and saved activations must fit in its memory."""
    need, total = global_batch * sample.input_bytes, sum(device_bytes)
    if need > total:
        raise ConfigError(f"--global-batch {global_batch}: its inputs alone are {_gib(need)} "
                          f"({sample.input_bytes:,} bytes per {model} sample), more than the cluster's "
                          f"{_gib(total)} of memory in all; use at most {total // sample.input_bytes:,}")
    per = sample.input_bytes + (sample.saved_bytes or 0)
    top = global_batch - (len(device_bytes) - 1)
    if profiler_bytes and top * per > profiler_bytes:
        what = "inputs and saved activations" if sample.saved_bytes else "inputs"
        most = profiler_bytes // per + len(device_bytes) - 1
        raise ConfigError(f"--global-batch {global_batch}: the profiler measures {model} on micro-batches of up "
                          f"to {top:,} samples on {profiler_where}, whose {what} alone take {_gib(top * per)} "
                          f"({per / 2**20:,.2f} MiB per sample), more than its {_gib(profiler_bytes)}; use at "
                          f"most --global-batch {most:,}")


# user:PASSWORD@ after // (or at the start: a URL missing its scheme), up to the last @ before the
# query: an unescaped @ in a password hides no part of it.
_USERINFO = re.compile(r"(?P<head>(?:^|//)[^/@:\s]*:)[^/?\s][^?\s]*@")
_QUERY_SECRET = re.compile(r"(?i)(?P<head>[?&;](?:password|passwd|pwd|secret|token|api_key|apikey)=)[^&;\s]*")


def masked_url(url: str) -> str:
    """A storage URL as it may be shown or stored: `postgresql://alice:PASSWORD@host/db` becomes
    `postgresql://alice:***@host/db` (SQLAlchemy's own rendering), and a password in the query string
    (`?password=...`) becomes `***` too.  A URL SQLAlchemy cannot parse is masked by pattern."""
    text = url
    try:
        from sqlalchemy.engine import make_url  # an Optuna dependency

        parsed = make_url(url)
        if parsed.password is not None:
            text = parsed.render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: the patterns below still apply
        pass
    text = _USERINFO.sub(lambda m: m.group("head") + "***@", text)
    return _QUERY_SECRET.sub(lambda m: m.group("head") + "***", text)


def _secrets(url: str) -> list[str]:
    found = [m.group(0)[len(m.group("head")):-1] for m in _USERINFO.finditer(url)]
    found += [m.group(0)[len(m.group("head")):] for m in _QUERY_SECRET.finditer(url)]
    try:
        from sqlalchemy.engine import make_url

        if make_url(url).password:
            found.append(str(make_url(url).password))
    except Exception:  # unparsable: the patterns found what there is
        pass
    return sorted({s for s in found if s}, key=len, reverse=True)


def hide_secrets(text: str, url: str) -> str:
    """`text` (a driver's error message, a log line) with the URL and every password in it masked."""
    text = text.replace(url, masked_url(url)) if url else text
    for secret in _secrets(url):
        if len(secret) >= 3:  # a one- or two-letter password would mask unrelated letters
            text = text.replace(secret, "***")
    return text


def storage_url(storage: str) -> None:
    """An Optuna RDB URL that cannot work fails here, before torch is imported: SQLAlchemy parses
    it, loads its dialect and driver, and connects to nothing (`create_engine` is lazy).  Journal
    files are checked where they are opened."""
    if storage.startswith("journal:") or storage.endswith(".journal"):
        return
    try:
        import sqlalchemy  # an Optuna dependency

        with warnings.catch_warnings():  # SQLAlchemy's warnings about the URL are lines of their own
            warnings.simplefilter("ignore")
            sqlalchemy.create_engine(storage)
    except Exception as e:  # parse, dialect and driver errors alike
        why = re.sub(r"\s*\(Background on this error at: [^)]*\)", "", f"{type(e).__name__}: {e}").strip()
        why = hide_secrets(why, storage)
        raise ConfigError(f"--storage {shown(masked_url(storage), 200)} cannot be opened ({why[:500]}); use an "
                          "Optuna storage URL that this machine can open, such as journal:results/hetsim.journal "
                          "or sqlite:///results/hetsim.db") from None


def model_fits_somewhere(wl, device_bytes: list[int]) -> None:
    """The fp32 training state (parameters, gradients, optimizer state) must fit in the devices and
    this host together, the most any plan (ZeRO-3 with offload) can spread it over."""
    import torch

    params = wl.params
    try:
        with torch.device("meta"):  # counted without allocating a byte
            params = params or sum(p.numel() for _, b in wl.build_blocks() for p in b.parameters())
    except Exception:  # a model that cannot be built on the meta device is measured as usual
        return
    _fits(wl.spec, params, wl.optimizer, device_bytes)


def user_model_fits_somewhere(spec: str, optimizer: str | None, device_bytes: list[int]) -> None:
    """`model_fits_somewhere` for `module:function`, checked before the module is built for real: one too
    large for the host would exhaust its memory while being built."""
    from hetsim.workloads.usermodel import meta_params

    counted = meta_params(spec)
    if counted is not None:
        _fits(spec, counted[0], optimizer or counted[1], device_bytes)


def _fits(spec: str, params: int, optimizer: str, device_bytes: list[int]) -> None:
    from hetsim.workloads.base import OPTIMIZER_STATE_PER_PARAM

    per_param = 4 * (2 + OPTIMIZER_STATE_PER_PARAM.get(optimizer, 2))
    need, host = params * per_param, host_memory_bytes()
    if need > sum(device_bytes) + host:
        raise ConfigError(
            f"model {spec}: {params / 1e9:.2f}B parameters need {need / 2**30:.1f} GiB for parameters, gradients "
            f"and {optimizer} state, more than all {len(device_bytes)} devices "
            f"({sum(device_bytes) / 2**30:.1f} GiB) and this host ({host / 2**30:.1f} GiB) hold together; "
            "choose a smaller model (" + ("fewer or narrower layers" if ":" in spec and not spec.startswith(
                ("hf:", "timm:")) else "--model-size, hf:...?layers=N&hidden=N") + ") or a larger cluster")


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
        raise ConfigError(f"{option} {shown(text)} is not a writable folder ({e.strerror or e}); choose another") from None
    return out
