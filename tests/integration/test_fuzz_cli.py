"""Fuzzing the command line and the cluster parser with Hypothesis (issue 19).

Generated option values, `--cluster` specs and TOML cluster files must end in one of two ways:
a valid plan (the CLI gets as far as profiling, which these tests replace by a stop), or exit code
2 with exactly one `hetsim: error:` line.  Never a traceback, a hang (each case runs under a
timer) or an allocation out of proportion to the input (each case's Python allocations are
traced).  The default run is small and the same every time (derandomized, part of `nox -s tests`);
`nox -s fuzz` runs many more, random examples (HETSIM_FUZZ=long).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import hetsim.search.app as app
import pytest
from hetsim.search.__main__ import main
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from hetsim.errors import ConfigError
from hetsim.hardware.cluster import Cluster, load_catalog, parse_cluster

ROOT = Path(__file__).resolve().parents[2]
LONG = os.environ.get("HETSIM_FUZZ", "") == "long"
# No "explain" phase: it traces every line, and a traced TOML parse runs a hundred times slower.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)
settings.register_profile("hetsim-ci", deadline=None, derandomize=True, database=None, print_blob=True,
                          phases=PHASES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("hetsim-long", deadline=None, print_blob=True, phases=PHASES,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = settings.get_profile("hetsim-long" if LONG else "hetsim-ci")
SCALE = int(os.environ.get("HETSIM_FUZZ_SCALE", "10" if LONG else "1"))  # examples: this times the default

CASE_SECONDS = 60  # a case that needs longer hangs: the slowest valid case takes seconds on a loaded 2-core VM
MAX_CASE_ALLOC_BYTES = 64 * 2**20  # Python allocations of one case; 100 M devices would need gigabytes
WORK = Path(tempfile.mkdtemp(prefix="hetsim-fuzz-"))  # the cwd of every case: relative --out paths land here
CATALOG_KEYS = sorted(load_catalog())


class ReachedProfiling(Exception):
    """Every check passed: the CLI was about to measure profiles."""


@contextlib.contextmanager
def bounded(seconds: float, max_bytes: int):
    """Fail a case that runs longer than `seconds` or allocates more than `max_bytes` (Python
    allocations, traced): a timer looks every 0.2 s, so a runaway case stops early, not at the end."""
    start = time.monotonic()

    def check(signum, frame):
        used = tracemalloc.get_traced_memory()[0]
        if used > max_bytes:
            raise MemoryError(f"one case holds {used / 2**20:.0f} MiB (limit {max_bytes / 2**20:.0f} MiB)")
        if time.monotonic() - start > seconds:
            raise TimeoutError(f"case ran over {seconds} s")

    # pytest-timeout may hold the one real-time timer: it is put back, less the time this case took.
    previous = signal.signal(signal.SIGALRM, check)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)
    tracemalloc.start()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 0.001))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= max_bytes, f"one case allocated {peak / 2**20:.0f} MiB"


def run_cli(argv: list[str]) -> tuple[object, str, str]:
    """main(argv) in this process, stopped where it would start profiling."""
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(WORK)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code
            except ReachedProfiling:
                rc = "valid"
    finally:
        os.chdir(cwd)
    return rc, out.getvalue(), err.getvalue()


def assert_clean(rc, out: str, err: str, argv: list[str]) -> None:
    event("valid plan" if rc == "valid" else f"exit {rc}")
    if rc == "valid":
        assert "Traceback" not in out + err, err[-2000:]
        return
    lines = err.splitlines()
    assert rc == 2, f"exit {rc!r} for {argv!r}:\n{err[-3000:]}"
    assert len(lines) == 1 and lines[0].startswith("hetsim: error: "), f"{argv!r}:\n{err[-3000:]}"
    assert "Traceback" not in out + err
    assert len(lines[0]) < 4000, f"a {len(lines[0])}-character error line"


@pytest.fixture(scope="module", autouse=True)
def stop_before_profiling():
    """Profiling is replaced by a stop; one valid run first imports what every case shares."""
    real = app.profiles_step

    def stop(*args, **kwargs):
        raise ReachedProfiling

    app.profiles_step = stop
    try:
        for model in ("mlp", "resnet18", "gpt"):
            rc, out, err = run_cli(["--model", model, "--cluster", "emu:1.0@1G,0.5@1G", "--out", "warm"])
            assert rc == "valid", err
        parse_cluster(f"catalog:{CATALOG_KEYS[0]}")
        yield
    finally:
        app.profiles_step = real


# ----------------------------------------------------------------------------- generated values

def no_nul(text: str) -> bool:
    return "\0" not in text  # argv cannot carry a NUL byte


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30).filter(no_nul)
NUMBERS = st.one_of(
    st.integers(-10, 10**6), st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["1e309", "-0", "+8", " 8 ", "0x10", "1_000"]),
).map(str)
BIG_TEXT = st.sampled_from(["9" * 5000, "x" * 5000, "1" * 31])
EMPTYISH = st.sampled_from(["", " ", "\t", "\n"])
VALUE = st.one_of(NUMBERS, TEXT, EMPTYISH, BIG_TEXT)


# Values at and around every bound, so that a few hundred examples reach each of them.
EDGE_SIZES = ["0", "1", "0.5", "1023K", "1M", "1G", "16T", "16.001T", "17T", "1e3G", "-1G", "inf", "nan", "4 G",
              "9" * 400 + "T", "1" * 41, "2G@1G", "1.5GiB", "0x10G"]
EDGE_SPEEDS = ["0", "0.001", "0.0009", "1", "1.0", "1.0000001", "2", "nan", "inf", "-inf", "-1", "1e-9", "true",
               "1e400", "", " "]


def size_text() -> st.SearchStrategy[str]:
    units = st.sampled_from(["", "K", "M", "G", "T", "GiB", "g", "P", " G"])
    return st.one_of(st.sampled_from(EDGE_SIZES),
                     st.builds(lambda n, u: f"{n}{u}", st.one_of(st.integers(-5, 10**20), st.floats()), units),
                     TEXT, EMPTYISH)


def speed_text() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(EDGE_SPEEDS), st.floats(min_value=0.001, max_value=1.0).map(str), NUMBERS, TEXT)


def emu_spec() -> st.SearchStrategy[str]:
    good = st.builds(lambda s, m: f"{s}@{m}", st.floats(0.001, 1.0).map(str), st.sampled_from(["1G", "512M", "2G"]))
    device = st.one_of(good, good, st.builds(lambda s, m: f"{s}@{m}", speed_text(), size_text()),
                       st.builds(lambda s, m: f"{s}@{m}", st.just("1.0"), size_text()),
                       st.builds(lambda s, m: f"{s}@{m}", speed_text(), st.just("1G")), TEXT)
    many = st.integers(1, 300).map(lambda n: ",".join(["1.0@1G"] * n))
    return st.one_of(st.lists(device, min_size=0, max_size=4).map(",".join), many).map(lambda b: "emu:" + b)


def catalog_spec() -> st.SearchStrategy[str]:
    key = st.one_of(st.sampled_from(CATALOG_KEYS), st.sampled_from(CATALOG_KEYS).map(str.upper), TEXT)
    count = st.one_of(st.just(""), st.sampled_from(["*0", "*1", "*1024", "*1025", "*", "*-1", "*01", "* 2", "*\u00b2"]),
                      st.integers(-3, 10**12).map(lambda n: f"*{n}"), TEXT.map(lambda t: "*" + t),
                      st.just("*" + "9" * 4000))
    item = st.builds(lambda k, c: k + c, key, count)
    return st.lists(item, min_size=0, max_size=5).map(lambda items: "catalog:" + ",".join(items))


# TOML files: structured ones ([[device]] tables of any field and value type) rendered by a small
# writer, huge or deeply nested ones, and raw text.

def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON's escapes are TOML's basic-string escapes
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


SCALAR = st.one_of(st.booleans(), st.integers(-(2**70), 2**70), st.floats(), TEXT, size_text(),
                   st.sampled_from(CATALOG_KEYS))
TOML_VALUE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=2),
                          max_leaves=6)
FIELD = st.one_of(st.sampled_from(["speed", "memory", "catalog", "name"]), TEXT)
DEVICE = st.dictionaries(FIELD, TOML_VALUE, max_size=4)
GOOD_DEVICE = st.one_of(
    st.builds(lambda s, m: {"speed": s, "memory": m}, st.floats(0.001, 1.0), st.sampled_from(["1G", "512M", 2**30])),
    st.builds(lambda k: {"catalog": k}, st.sampled_from(CATALOG_KEYS)),
)
EDGE_DEVICE = st.one_of(  # one field at or past a bound, the others valid
    st.builds(lambda s: {"speed": s, "memory": "1G"}, st.one_of(st.sampled_from(EDGE_SPEEDS), SCALAR)),
    st.builds(lambda m: {"speed": 0.5, "memory": m}, st.one_of(st.sampled_from(EDGE_SIZES), SCALAR)),
    st.builds(lambda m: {"catalog": "t4", "memory": m}, st.one_of(st.sampled_from(EDGE_SIZES), SCALAR)),
    st.builds(lambda n: {"speed": 1.0, "memory": "1G", "name": n}, st.one_of(TEXT, SCALAR)),
)


def render_devices(devices: list[dict], extra: dict) -> str:
    parts = [f"{json.dumps(k)} = {toml_value(v)}" for k, v in extra.items()]
    for d in devices:
        parts.append("[[device]]")
        parts += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in d.items()]
    return "\n".join(parts) + "\n"


TOML_TEXT = st.one_of(
    st.builds(render_devices, st.lists(st.one_of(DEVICE, GOOD_DEVICE, EDGE_DEVICE), max_size=4),
              st.dictionaries(TEXT, SCALAR, max_size=1)),
    st.integers(1, 1100).map(lambda n: '[[device]]\ncatalog = "t4"\n' * n),
    st.integers(1, 100).map(lambda n: '[[device]]\nspeed = 1.0\nmemory = "1G"\n' * n),
    st.integers(1, 100_000).map(lambda n: "a = [" + "1," * n + "]\n"),  # over the 64 KiB limit from 32,768
    st.integers(1, 40_000).map(lambda n: "a = " + "[" * n + "]" * n + "\n"),
    st.just('[[device]]\nspeed = 1.0\nmemory = "1G"\nspeed = 0.5\n'),  # a duplicate key
    st.text(max_size=200).filter(no_nul),
)


def cluster_file(text: str) -> str:
    fd, name = tempfile.mkstemp(suffix=".toml", dir=WORK)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    return name


SPECIAL_PATHS = st.sampled_from(["/dev/zero", "/dev/null", "/", ".", "missing.toml", "/proc/self/mem", "dir/"])
CLUSTER = st.one_of(emu_spec(), catalog_spec(), TOML_TEXT.map(cluster_file), SPECIAL_PATHS, TEXT, EMPTYISH,
                    st.sampled_from(["cuda", "emu", "catalog", "emu:1.0@1G,0.5@1G"]))


# ----------------------------------------------------------------------------- the cluster parser

def parse_outcome(spec: str) -> Cluster | str:
    try:
        return parse_cluster(spec)
    except ConfigError as e:  # every refusal is a ConfigError (ClusterSpecError, UnknownNameError)
        return str(e)


@settings(PROFILE, max_examples=150 * SCALE)
@given(spec=CLUSTER)
def test_cluster_parser_refuses_cleanly_and_promptly(spec):
    with bounded(CASE_SECONDS, MAX_CASE_ALLOC_BYTES):
        got = parse_outcome(spec)
    event(f"a {got.source} cluster" if isinstance(got, Cluster) else "refused")
    if isinstance(got, Cluster):
        assert 1 <= len(got.devices) <= 1024
        assert all(1024 <= d.memory_bytes <= 16 * 2**40 and 0.001 <= d.speed <= 1 for d in got.devices)
    else:
        assert got.strip(), "an empty error message"


# ----------------------------------------------------------------------------- the whole command line

OPTIONS = {
    "--model": st.one_of(st.sampled_from(["mlp", "gpt", "resnet18", "gn_resnet", "RESNET18", "resnet18 ",
                                          "hetsim_fuzz_no_module:build", ":build", "os.path:join", "a:b:c"]),
                         TEXT.filter(lambda t: ":" not in t), EMPTYISH),  # no random module:function imports
    "--cluster": CLUSTER,
    "--global-batch": VALUE, "--image-size": VALUE, "--trials": VALUE, "--top-k": VALUE, "--steps": VALUE,
    "--warmup": VALUE, "--repeats": VALUE, "--calib-repeats": VALUE, "--timeout": VALUE, "--seed": VALUE, "--min-local-batch": VALUE, "--node-rank": VALUE,
    "--strategies": st.one_of(st.lists(st.sampled_from(["ddp", "zero", "pipeline", "hybrid", "", "DDP", "x"]),
                                       max_size=3).map(",".join), TEXT, EMPTYISH),
    "--precisions": st.one_of(st.sampled_from(["fp32", "bf16", "fp16", "fp32,bf16", "fp8", ",", "fp32,,"]), TEXT),
    "--optimizer": st.one_of(st.sampled_from(["adamw", "adam", "sgd", "lion", "ADAMW"]), TEXT, EMPTYISH),
    "--storage": st.one_of(st.sampled_from(["sqlite://", "sqlite:///fuzz.db", "nosuch://x", "::::", "sqlite:///dir/",
                                            "postgresql://alice:PASSWORD@db.invalid/x", "sqlite:////dev/zero",
                                            "mysql://u:hunter22@h/db?password=hunter22"]), TEXT, EMPTYISH),
    "--study": st.one_of(TEXT, EMPTYISH, st.sampled_from(["..", "a/b", "ok-study", "\u540d" * 100])),
    "--out": st.one_of(TEXT.filter(lambda t: not t.startswith(("/", "~")) and ".." not in t), EMPTYISH,
                       st.sampled_from(["/dev/null", "/proc/1/x", "afile/sub", "a" * 300])),
    "--nnodes": st.one_of(st.sampled_from(["1", "2", "1:4", "4:1", "0", "300"]), VALUE),
    "--rdzv-endpoint": st.one_of(st.sampled_from(["h:29500", "[::1]:1", "h:0", "h:99999", "h"]), TEXT, EMPTYISH),
}
FLAGS = ["--no-execute", "--reprofile", "--no-checkpointing"]


@st.composite
def command_lines(draw) -> list[str]:
    argv = ["--model", "mlp", "--cluster", "emu:1.0@1G,0.5@1G", "--out", "out"]
    for name in draw(st.lists(st.sampled_from(sorted(OPTIONS)), min_size=1, max_size=4, unique=True)):
        value = draw(OPTIONS[name])
        argv += [f"{name}={value}"] if value.startswith("-") else [name, value]
    return argv + draw(st.lists(st.sampled_from(FLAGS), max_size=2, unique=True))


@settings(PROFILE, max_examples=50 * SCALE)
@given(argv=command_lines())
def test_command_line_ends_in_a_plan_or_one_error_line(argv):
    (WORK / "afile").write_text("a file, not a folder")
    (WORK / "dir").mkdir(exist_ok=True)
    with bounded(CASE_SECONDS, MAX_CASE_ALLOC_BYTES):
        rc, out, err = run_cli(argv)
    assert_clean(rc, out, err, argv)
    if "PASSWORD" in " ".join(argv) or "hunter22" in " ".join(argv):
        assert "PASSWORD" not in out + err and "hunter22" not in out + err, err


# ----------------------------------------------------------------------------- the real entry point

BAD = st.one_of(
    st.tuples(st.sampled_from(sorted(OPTIONS)), EMPTYISH),  # an option given with nothing
    st.tuples(st.sampled_from(["--global-batch", "--trials", "--top-k", "--steps", "--warmup", "--image-size"]),
              st.integers(2**20 + 1, 10**30).map(str)),  # above every limit
    st.tuples(st.just("--cluster"), st.integers(1025, 10**15).map(lambda n: f"catalog:t4*{n}")),
    st.tuples(st.just("--cluster"), st.floats(1.01, 1e300).map(lambda s: f"emu:{s}@1G")),
)


@settings(PROFILE, max_examples=3 * SCALE)
@given(bad=BAD)
def test_python_m_hetsim_search_exits_2_with_one_line(bad, tmp_path_factory):
    """A handful of certainly-bad command lines through `python -m hetsim.search` itself: exit 2,
    one line, within the time and memory a refusal needs."""
    name, value = bad
    argv = [sys.executable, "-m", "hetsim.search", "--model", "mlp", "--out", str(tmp_path_factory.mktemp("o")),
            f"{name}={value}"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, status, usage = time.monotonic() + 120, None, None
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail(f"{argv!r} ran over 120 s")
    proc.returncode = os.waitstatus_to_exitcode(status)
    out, err = proc.stdout.read(), proc.stderr.read()
    assert_clean(proc.returncode, out, err, argv)
    assert usage.ru_maxrss < 2 * 2**20, f"peak RSS {usage.ru_maxrss / 2**10:.0f} MiB"  # kilobytes on Linux
