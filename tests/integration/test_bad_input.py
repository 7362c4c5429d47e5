"""Bad input through the real CLI: one line on stderr naming the value, exit code 2, no traceback.

Every case runs `hetsim.search.__main__.main([...])` in this process (importing torch once
instead of once per case); one case also runs `python -m hetsim.search` as a subprocess to
show the two are the same.  Every case must fail before anything is profiled: the whole
file runs in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hetsim.search.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "emu:1.0@1G,0.5@1G"


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_error(rc: int, out: str, err: str, *values: str) -> str:
    assert rc == 2, (rc, out[-2000:], err[-2000:])
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("hetsim: error: "), lines[0]
    for v in values:
        assert v in lines[0], f"{v!r} not named in: {lines[0]}"
    assert "Traceback" not in err + out
    return lines[0]


def toml(tmp_path: Path, text: str, name: str = "cluster.toml") -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


# (id, extra argv, values the message must contain).  Values containing {tmp} are formatted.
CASES: list[tuple[str, list[str], list[str]]] = [
    # names
    ("unknown-model", ["--model", "nope"], ["'nope'", "mlp", "resnet50", "module:function"]),
    ("model-typo", ["--model", "resnt18"], ["'resnt18'", "did you mean 'resnet18'"]),
    ("unknown-strategy", ["--strategies", "ddp,nope"], ["'nope'", "ddp"]),
    ("empty-strategy", ["--strategies", "ddp,"], ["'ddp,'", "empty"]),
    ("unknown-precision", ["--precisions", "fp8"], ["'fp8'", "fp32"]),
    ("unknown-optimizer", ["--optimizer", "lion"], ["'lion'", "adamw"]),
    # --cluster
    ("speed-zero", ["--cluster", "emu:0@1G"], ["'0'", "> 0"]),
    ("speed-negative", ["--cluster", "emu:-0.5@1G"], ["'-0.5'", "> 0"]),
    ("speed-above-one", ["--cluster", "emu:2.0@1G"], ["'2.0'", "1.0"]),
    ("memory-zero", ["--cluster", "emu:1.0@0G"], ["'0G'", "greater than zero"]),
    ("memory-negative", ["--cluster", "emu:1.0@-2G"], ["'-2G'", "greater than zero"]),
    ("memory-missing", ["--cluster", "emu:1.0"], ["'1.0'", "SPEED@MEM"]),
    ("memory-not-a-size", ["--cluster", "emu:1.0@lots"], ["'lots'", "4G"]),
    ("emu-empty", ["--cluster", "emu:"], ["'emu:'", "emu:1.0@4G"]),
    ("catalog-typo", ["--cluster", "catalog:rtx3090"], ["'rtx3090'", "did you mean 'rtx_3090'"]),
    ("catalog-count-zero", ["--cluster", "catalog:t4*0"], ["'0'", ">= 1"]),
    ("cluster-gibberish", ["--cluster", "gpu-farm"], ["'gpu-farm'", "emu:SPEED@MEM"]),
    ("cluster-file-missing", ["--cluster", "{tmp}/missing.toml"], ["missing.toml", "does not exist"]),
    ("cluster-file-is-folder", ["--cluster", "{tmp}/"], ["{tmp}", "cannot be read"]),
    # batch, counts, times
    ("global-batch-zero", ["--global-batch", "0"], ["'0'", "> 0"]),
    ("global-batch-negative", ["--global-batch", "-4"], ["'-4'", "> 0"]),
    ("global-batch-words", ["--global-batch", "lots"], ["'lots'", "whole number"]),
    ("global-batch-below-devices", ["--global-batch", "1"], ["--global-batch 1", "2 devices", "at least 2"]),
    ("global-batch-below-min-local", ["--global-batch", "6", "--min-local-batch", "4"],
     ["--global-batch 6", "at least 8"]),
    ("global-batch-batchnorm", ["--model", "resnet18", "--image-size", "32", "--global-batch", "3"],
     ["--global-batch 3", "BatchNorm", "at least 4"]),
    ("trials-zero", ["--trials", "0"], ["'0'", "> 0"]),
    ("top-k-zero", ["--top-k", "0"], ["'0'", "> 0"]),
    ("steps-negative", ["--steps", "-1"], ["'-1'", "> 0"]),
    ("warmup-one", ["--warmup", "1"], ["--warmup 1", "2 or more"]),
    ("timeout-zero", ["--timeout", "0"], ["'0'", "> 0"]),
    ("timeout-nan", ["--timeout", "nan"], ["'nan'", "finite"]),
    ("seed-negative", ["--seed", "-1"], ["--seed -1"]),
    # image size
    ("image-too-small", ["--model", "resnet18", "--image-size", "8"], ["--image-size 8", "at least 32"]),
    ("image-too-large", ["--model", "gn_resnet", "--image-size", "100000"], ["--image-size 100000", "GiB"]),
    ("image-size-on-mlp", ["--image-size", "32"], ["--image-size 32", "mlp", "drop --image-size"]),
    # storage, study, output, multi-node
    ("storage-bad-scheme", ["--storage", "nosuch://x"], ["'nosuch://x'", "sqlite:///"]),
    ("storage-unopenable", ["--storage", "sqlite:////nonexistent-dir-hetsim/x.db"],
     ["sqlite:////nonexistent-dir-hetsim/x.db", "cannot be opened"]),
    ("study-escapes-folder", ["--study", "../escape"], ["'../escape'", "'/'"]),
    ("out-is-a-file", ["--out", "{tmp}/a-file"], ["a-file", "not a writable folder"]),
    ("out-is-the-recordings", ["--out", str(ROOT / "results")], ["results", "committed recordings", "results/local"]),
    ("nnodes-without-endpoint", ["--nnodes", "2"], ["--nnodes 2", "--rdzv-endpoint"]),
    ("nnodes-words", ["--nnodes", "many"], ["'many'", "MIN:MAX"]),
    ("endpoint-without-port", ["--nnodes", "2", "--rdzv-endpoint", "node0"], ["'node0'", "HOST:PORT"]),
    ("fault-spec", ["--inject-fault", "boom"], ["'boom'", "KIND"]),
    # --model module:function
    ("user-module-missing", ["--model", "no_such_module_hetsim:build"], ["'no_such_module_hetsim'", "PYTHONPATH"]),
    ("user-function-missing", ["--model", "os:no_such_function"], ["'no_such_function'"]),
    ("user-function-wrong-type", ["--model", "os:getcwd"], ["getcwd()", "returned str", "Workload"]),
    ("user-spec-no-module", ["--model", ":build"], ["':build'", "module:function"]),
    ("user-module-raises", ["--model", "hetsim_bad_user_mod:build"], ["hetsim_bad_user_mod", "ZeroDivisionError"]),
    ("user-function-raises", ["--model", "hetsim_user_mod:raises"], ["raises()", "ValueError", "no blocks today"]),
]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An --out folder, a file that is not a folder, and user modules on sys.path."""
    (tmp_path / "a-file").write_text("not a folder")
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "hetsim_bad_user_mod.py").write_text("1 / 0\n")
    (mods / "hetsim_user_mod.py").write_text("def raises():\n    raise ValueError('no blocks today')\n")
    monkeypatch.syspath_prepend(str(mods))
    return tmp_path


@pytest.mark.parametrize(("extra", "values"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_option(extra, values, env, capsys):
    fmt = lambda s: s.replace("{tmp}", str(env))  # noqa: E731
    argv = ["--model", "mlp", "--cluster", CLUSTER, "--out", str(env / "OUT"), "--trials", "2", "--no-execute"]
    rc, out, err = run_main(argv + [fmt(a) for a in extra], capsys)
    assert_one_error(rc, out, err, *[fmt(v) for v in values])


TOML_CASES = [
    ("toml-missing-memory", "[[device]]\nspeed = 1.0\n", ["device 0", "memory"]),
    ("toml-zero-memory", "[[device]]\nspeed = 1.0\nmemory = \"0G\"\n", ["'0G'", "greater than zero"]),
    ("toml-negative-memory", "[[device]]\nspeed = 1.0\nmemory = -2\n", ["'-2'", "greater than zero"]),
    ("toml-zero-speed", "[[device]]\nspeed = 0\nmemory = \"1G\"\n", ["'0'", "> 0"]),
    ("toml-syntax", "[[device]\nspeed = 1.0\n", ["cluster.toml", "not valid TOML"]),
    ("toml-unknown-field", "[[device]]\nspeed = 1.0\nmemroy = \"1G\"\n", ["'memroy'", "did you mean 'memory'"]),
    ("toml-no-devices", "[[devices]]\nspeed = 1.0\n", ["[[device]]", "devices"]),
    ("toml-unknown-catalog", "[[device]]\ncatalog = \"rtx3090\"\n", ["'rtx3090'", "did you mean 'rtx_3090'"]),
]


@pytest.mark.parametrize(("text", "values"), [c[1:] for c in TOML_CASES], ids=[c[0] for c in TOML_CASES])
def test_bad_cluster_file(text, values, tmp_path, capsys):
    path = toml(tmp_path, text)
    rc, out, err = run_main(["--model", "mlp", "--cluster", path, "--out", str(tmp_path / "OUT"), "--no-execute"],
                            capsys)
    assert_one_error(rc, out, err, *values)


def test_unreadable_cluster_file(capsys):
    """A cluster file without read permission.  Root reads any file, so as root (CI) the CLI runs
    in a forked child that has dropped to the unprivileged user `nobody` first."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)  # nobody may enter the folder, but not read the file in it
        path = toml(Path(d), "[[device]]\nspeed = 1.0\nmemory = \"1G\"\n")
        os.chmod(path, 0)
        (Path(d) / "OUT").mkdir(mode=0o777)
        os.chmod(Path(d) / "OUT", 0o777)
        argv = ["--model", "mlp", "--cluster", path, "--out", str(Path(d) / "OUT")]
        rc, out, err = run_unprivileged(argv, capsys) if os.geteuid() == 0 else run_main(argv, capsys)
        assert_one_error(rc, out, err, path, "cannot be read", "Permission denied")


def run_unprivileged(argv: list[str], capsys, uid: int = 65534) -> tuple[int, str, str]:
    """`run_main(argv)` in a forked child running as `uid`.  The child cannot import from root's
    Python install, so a bad --cluster first makes this process import what the CLI imports
    before it reads the cluster."""
    import os

    run_main(["--model", "mlp", "--cluster", "emu:0@1G"], capsys)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, run the CLI, send back what it printed
        code = 1
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            assert os.geteuid() == uid
            rc, out, err = run_main(argv, capsys)
            with os.fdopen(write_fd, "w") as f:
                json.dump([rc, out, err], f)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and text, f"the unprivileged child failed ({status})"
    return tuple(json.loads(text))


PROFILE_CASES = [
    ("garbage", "this is not json {", ["device.json", "not valid JSON", "--reprofile"]),
    ("truncated", '{"kind": "emu-cpu", "fingerprint": {"kind": "emu-cpu", "dev', ["device.json", "not valid JSON"]),
    ("missing-fields", '{"kind": "emu-cpu"}', ["device.json", "misses or has malformed fields"]),
    ("wrong-types", json.dumps({"kind": "emu-cpu", "fingerprint": {}, "matmul_flops": {"fp32": "fast"},
                                "copy_bps": 1.0}), ["device.json", "malformed"]),
    ("a-list", "[1, 2, 3]", ["device.json", "malformed"]),
]


@pytest.mark.parametrize(("text", "values"), [c[1:] for c in PROFILE_CASES], ids=[c[0] for c in PROFILE_CASES])
def test_corrupt_profile(text, values, tmp_path, capsys):
    """A damaged recorded profile is named (delete it or --reprofile), not silently overwritten."""
    out_dir = tmp_path / "OUT"
    prof = out_dir / "profiles" / "emu-cpu" / "device.json"
    prof.parent.mkdir(parents=True)
    prof.write_text(text)
    rc, out, err = run_main(["--model", "mlp", "--cluster", CLUSTER, "--out", str(out_dir), "--trials", "2",
                             "--no-execute"], capsys)
    assert_one_error(rc, out, err, str(prof), *values)
    assert prof.read_text() == text  # left for the user to look at
    assert not (out_dir / "profiles" / "emu-cpu" / "model-mlp.json").exists()  # nothing was measured


def test_storage_is_checked_before_profiling(tmp_path, capsys):
    out_dir = tmp_path / "OUT"
    rc, out, err = run_main(["--model", "mlp", "--cluster", CLUSTER, "--out", str(out_dir),
                             "--storage", "nosuch://x"], capsys)
    assert_one_error(rc, out, err, "nosuch://x")
    assert not (out_dir / "profiles").exists()


def test_stale_fingerprint_is_remeasured_not_an_error(tmp_path):
    from hetsim.profiling.obtain import load_or_measure
    from hetsim.profiling.store import DeviceProfile, save

    path = tmp_path / "device.json"
    save(DeviceProfile(kind="emu-cpu", fingerprint={"torch": "1.0"}, matmul_flops={"fp32": 1.0}, copy_bps=1.0), path)
    said: list[str] = []
    fresh = DeviceProfile(kind="emu-cpu", fingerprint={"torch": "2.0"}, matmul_flops={"fp32": 2.0}, copy_bps=2.0)
    got = load_or_measure(path, DeviceProfile, {"torch": "2.0"}, lambda: fresh, False, said.append)
    assert got == fresh
    assert any("measured for another setup" in s and "'1.0'" in s and "re-measuring" in s for s in said), said
    assert json.loads(path.read_text())["fingerprint"] == {"torch": "2.0"}


def test_subprocess_cli_gives_the_same_one_line(tmp_path):
    """The real entry point, `python -m hetsim.search`, behaves like main()."""
    p = subprocess.run([sys.executable, "-m", "hetsim.search", "--model", "mlp", "--cluster", "emu:1.0@0G",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert_one_error(p.returncode, p.stdout, p.stderr, "'0G'")
