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
    ("image-too-large", ["--model", "gn_resnet", "--image-size", "2048", "--cluster", "emu:1.0@16M"],
     ["--image-size 2048", "largest device"]),
    ("image-size-huge", ["--model", "gn_resnet", "--image-size", "100000"], ["'100000'", "limit of 2,048"]),
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
    # upper bounds (issue 19): checked before anything is built or measured
    ("global-batch-20-digits", ["--model", "resnet18", "--global-batch", "99999999999999999999"],
     ["'99999999999999999999'", "limit of 1,048,576"]),
    ("global-batch-5000-digits", ["--global-batch", "9" * 5000], ["5,000 characters", "limit"]),
    ("global-batch-inputs-exceed-cluster", ["--model", "resnet18", "--image-size", "128", "--global-batch", "40000"],
     ["--global-batch 40000", "inputs alone", "2.0 GiB", "at most 10,922"]),
    ("global-batch-profiler-memory", ["--model", "gpt", "--global-batch", "100000"],
     ["--global-batch 100000", "profiler", "saved activations", "use at most"]),
    ("image-huge-for-profiler", ["--model", "resnet18", "--image-size", "2048"], ["profiler", "resnet18", "MiB per sample"]),
    ("catalog-count-huge", ["--cluster", "catalog:t4*100000000"], ["100,000,000 devices", "limit is 1024"]),
    ("catalog-count-5000-digits", ["--cluster", "catalog:t4*" + "9" * 4000], ["limit is 1024"]),
    ("catalog-count-unicode-digit", ["--cluster", "catalog:t4*\u00b2"], ["'\u00b2'", "whole number"]),
    ("catalog-count-missing", ["--cluster", "catalog:t4*"], ["'t4*'", "whole number"]),
    ("catalog-too-many-items", ["--cluster", "catalog:" + ",".join(["t4"] * 1100)], ["1,100 devices", "limit is 1024"]),
    ("emu-too-many-devices", ["--cluster", "emu:" + ",".join(["1.0@1G"] * 65)], ["65 emulated devices", "limit is 64"]),
    ("memory-above-16T", ["--cluster", "emu:1.0@17T"], ["'17T'", "16T"]),
    ("memory-400-digits", ["--cluster", "emu:1.0@" + "9" * 400 + "T"], ["401 characters", "not a size"]),
    ("memory-below-1K", ["--cluster", "emu:1.0@0.5"], ["'0.5'", "below 1K"]),
    ("speed-tiny", ["--cluster", "emu:1e-9@1G"], ["'1e-9'", "0.001"]),
    ("speed-inf", ["--cluster", "emu:inf@1G"], ["'inf'", "finite"]),
    ("trials-huge", ["--trials", "100001"], ["'100001'", "limit of 100,000"]),
    ("top-k-huge", ["--top-k", "101"], ["'101'", "limit of 100"]),
    ("steps-huge", ["--steps", "10001"], ["'10001'", "limit of 10,000"]),
    ("warmup-huge", ["--warmup", "1001"], ["'1001'", "limit of 1,000"]),
    ("repeats-huge", ["--repeats", "11"], ["'11'", "limit of 10"]),
    ("repeats-zero", ["--repeats", "0"], ["'0'", "> 0"]),
    ("calib-repeats-huge", ["--calib-repeats", "11"], ["'11'", "limit of 10"]),
    ("calib-repeats-zero", ["--calib-repeats", "0"], ["'0'", "> 0"]),
    ("timeout-huge", ["--timeout", "1e9"], ["'1e9'", "limit of 86,400"]),
    ("timeout-tiny", ["--timeout", "1e-300"], ["'1e-300'", "below 1 second"]),
    ("image-size-huge-number", ["--image-size", "9" * 40], ["limit of 2,048"]),
    ("min-local-batch-huge", ["--min-local-batch", "2000000"], ["'2000000'", "limit of 1,048,576"]),
    ("seed-5000-digits", ["--seed", "9" * 5000], ["--seed", "5,000 characters", "whole number"]),
    ("nnodes-huge", ["--nnodes", "100000", "--rdzv-endpoint", "h:29500"], ["'100000'", "limit of 1024"]),
    ("endpoint-port-5000-digits", ["--nnodes", "2", "--rdzv-endpoint", "h:" + "9" * 4000], ["HOST:PORT"]),
    ("value-too-long", ["--cluster", "x" * 5000], ["5,000 characters", "longer than 4,096"]),
    ("study-too-many-bytes", ["--study", "\u540d" * 100], ["300 bytes", "limit is 200"]),
    # explicitly empty values (issue 19): an unset shell variable is not the default
    *[(f"empty{opt}", [opt, value], [f"{opt} {value!r}", "empty"])
      for opt in ("--model", "--cluster", "--strategies", "--storage", "--study", "--out", "--precisions",
                  "--optimizer", "--nnodes", "--rdzv-endpoint", "--global-batch", "--image-size", "--trials",
                  "--top-k", "--steps", "--warmup", "--repeats", "--calib-repeats", "--timeout", "--seed", "--min-local-batch", "--node-rank")
      for value in ("",)],
    ("blank-cluster", ["--cluster", "   "], ["--cluster '   '", "empty"]),
    ("blank-model", ["--model", " \t"], ["empty"]),
    # secrets (issue 19): a storage URL is shown with its password masked
    ("storage-password-masked", ["--storage", "postgresql://alice:PASSWORD@host/db"],
     ["'postgresql://alice:***@host/db'", "cannot be opened"]),
    ("storage-query-password-masked", ["--storage", "mysql://bob:s3cret!x@h/db?password=s3cret!x"],
     ["bob:***@h", "password=***"]),
    ("storage-not-a-database", ["--storage", "sqlite:///{tmp}/a-file"], ["a-file", "not a database"]),
    ("storage-a-folder", ["--storage", "sqlite:///{tmp}"], ["cannot be opened"]),
    ("storage-unknown-dialect", ["--storage", "duckdb:///x"], ["'duckdb:///x'", "cannot be opened"]),
    ("storage-unparsable", ["--storage", "::::"], ["'::::'", "cannot be opened"]),
    ("storage-journal-dev-zero", ["--storage", "journal:/dev/zero"], ["'journal:/dev/zero'", "not a regular file"]),
    ("storage-journal-no-folder", ["--storage", "journal:/nonexistent-hetsim/x.journal"], ["does not exist"]),
    ("trial-delay-nan", ["--trial-delay", "nan"], ["'nan'", "0 to 60"]),
    ("jobs-huge", ["--jobs", "1000"], ["'1000'", "limit of 64"]),
    # paths that are not what they should be
    ("cluster-dev-zero", ["--cluster", "/dev/zero"], ["'/dev/zero'", "not a regular file"]),
    ("cluster-is-a-folder-named-toml", ["--cluster", "{tmp}/mods"], ["mods", "folder"]),
    ("out-inside-a-file", ["--out", "{tmp}/a-file/sub"], ["a-file/sub", "not a writable folder"]),
    ("out-dev-null", ["--out", "/dev/null"], ["'/dev/null'", "not a writable folder"]),
    ("unknown-option", ["--global-bach", "8"], ["--global-bach"]),
    ("stray-positional", ["resnet50"], ["unrecognized", "resnet50"]),
    # --model module:function
    ("user-module-missing", ["--model", "no_such_module_hetsim:build"], ["'no_such_module_hetsim'", "PYTHONPATH"]),
    ("user-function-missing", ["--model", "os:no_such_function"], ["'no_such_function'"]),
    ("user-function-wrong-type", ["--model", "os:getcwd"], ["getcwd()", "returned str", "Workload"]),
    ("user-spec-no-module", ["--model", ":build"], ["':build'", "module:function"]),
    ("user-module-raises", ["--model", "hetsim_bad_user_mod:build"], ["hetsim_bad_user_mod", "ZeroDivisionError"]),
    ("user-function-raises", ["--model", "hetsim_user_mod:raises"], ["raises()", "ValueError", "no blocks today"]),
    # a user's plain module (tests/assets/user_models.py) and the size options
    ("user-batch-shapes", ["--model", "user_models:bad_shapes"], ["user_models:bad_shapes", "need 2 samples"]),
    ("user-loss-not-scalar", ["--model", "user_models:bad_loss"], ["user_models:bad_loss", "one number", ".mean()"]),
    ("user-module-fails-to-build", ["--model", "user_models:broken"], ["broken()", "fails to build"]),
    ("model-size-unknown", ["--model", "gpt", "--model-size", "huge"], ["'huge'", "tiny", "xl"]),
    ("model-size-not-sized", ["--model-size", "tiny"], ["--model-size tiny", "mlp", "gpt"]),
    ("seq-len-not-sequence", ["--seq-len", "16"], ["--seq-len 16", "mlp", "drop --seq-len"]),
    ("hf-unknown", ["--model", "hf:gpt5"], ["'gpt5'", "gpt2", "llama"]),
    ("hf-bad-override", ["--model", "hf:gpt2?layers=0"], ["layers=0", "KEY=N"]),
    ("model-too-large", ["--model", "hf:llama?layers=400&hidden=16384&heads=128&intermediate=53248"],
     ["hf:llama", "more than all 2 devices", "this host"]),
    ("user-model-too-large", ["--model", "user_models:too_large"],
     ["user_models:too_large", "30.07B parameters", "more than all 2 devices", "this host", "fewer or narrower"]),
    ("user-model-sparse-gradients", ["--model", "user_models:sparse_bag"],
     ["user_models:sparse_bag", "sparse=True", "sparse=False"]),
    ("image-size-not-image-model", ["--model", "hf:gpt2", "--image-size", "64"],
     ["--image-size 64", "hf:gpt2", "timm:NAME", "drop --image-size"]),
    ("image-size-user-model", ["--model", "user_models:tagger", "--image-size", "64"],
     ["--image-size 64", "user_models:tagger", "own batch maker", "drop --image-size"]),
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
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "assets"))
    return tmp_path


def test_missing_extra_says_how_to_install(env, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the [hf] extra were not installed
    rc, out, err = run_main(["--model", "hf:gpt2", "--cluster", CLUSTER, "--out", str(env / "OUT"), "--no-execute"],
                            capsys)
    assert_one_error(rc, out, err, "hf:gpt2", "transformers", 'pip install -e ".[hf]"')


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
    # issue 19: bounds, types, duplicates and malformed files
    ("toml-duplicate-key", "[[device]]\nspeed = 1.0\nmemory = \"1G\"\nspeed = 0.5\n", ["not valid TOML"]),
    ("toml-too-many-devices", "[[device]]\ncatalog = \"t4\"\n" * 1025, ["1,025 devices", "limit is 1024"]),
    ("toml-too-many-emulated", "[[device]]\nspeed = 1.0\nmemory = \"1G\"\n" * 65, ["65 emulated devices"]),
    ("toml-over-64KiB", "a = [" + "1," * 40_000 + "]\n", ["larger than 64 KiB"]),
    ("toml-deep-nesting", "a = " + "[" * 5_000 + "]" * 5_000 + "\n", ["not valid TOML"]),
    ("toml-5000-digit-int", "[[device]]\nspeed = 1.0\nmemory = " + "9" * 5000 + "\n", ["not valid TOML"]),
    ("toml-memory-above-16T", "[[device]]\nspeed = 1.0\nmemory = \"20T\"\n", ["'20T'", "16T"]),
    ("toml-memory-inf", "[[device]]\nspeed = 1.0\nmemory = inf\n", ["'inf'", "not a size"]),
    ("toml-speed-nan", "[[device]]\nspeed = nan\nmemory = \"1G\"\n", ["'nan'", "finite"]),
    ("toml-speed-bool", "[[device]]\nspeed = true\nmemory = \"1G\"\n", ["speed is a bool"]),
    ("toml-memory-list", "[[device]]\nspeed = 1.0\nmemory = [1]\n", ["memory is a list"]),
    ("toml-catalog-int", "[[device]]\ncatalog = 5\n", ["catalog is a int"]),
    ("toml-catalog-memory-huge", "[[device]]\ncatalog = \"t4\"\nmemory = \"99T\"\n", ["'99T'", "16T"]),
    ("toml-name-newline", "[[device]]\nspeed = 1.0\nmemory = \"1G\"\nname = \"a\\nb\"\n", ["name", "printable"]),
    ("toml-device-not-array", "[device]\nspeed = 1.0\nmemory = \"1G\"\n", ["[[device]]"]),
    ("toml-device-int", "device = 5\n", ["[[device]]"]),
    ("toml-extra-top-level", "[[device]]\nspeed = 1.0\nmemory = \"1G\"\n[[devices]]\n", ["'devices'", "top-level"]),
    ("toml-empty", "", ["it is empty"]),
]


@pytest.mark.parametrize(("text", "values"), [c[1:] for c in TOML_CASES], ids=[c[0] for c in TOML_CASES])
def test_bad_cluster_file(text, values, tmp_path, capsys):
    path = toml(tmp_path, text)
    rc, out, err = run_main(["--model", "mlp", "--cluster", path, "--out", str(tmp_path / "OUT"), "--no-execute"],
                            capsys)
    assert_one_error(rc, out, err, *values)


def test_cluster_file_not_utf8(tmp_path, capsys):
    path = tmp_path / "cluster.toml"
    path.write_bytes(b"\xff\xfe[[device]]\n")
    rc, out, err = run_main(["--model", "mlp", "--cluster", str(path), "--out", str(tmp_path / "OUT")], capsys)
    assert_one_error(rc, out, err, "not UTF-8")


def test_cluster_file_fifo_does_not_hang(tmp_path, capsys):
    import os

    path = tmp_path / "cluster.toml"
    os.mkfifo(path)  # reading it would block forever
    rc, out, err = run_main(["--model", "mlp", "--cluster", str(path), "--out", str(tmp_path / "OUT")], capsys)
    assert_one_error(rc, out, err, "not a regular file")


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


@pytest.mark.parametrize("argv", [
    ["--model", "resnet18", "--global-batch", "99999999999999999999", "--no-execute"],
    ["--cluster", "catalog:t4*100000000"],
    ["--cluster", ""],
], ids=["global-batch-20-digits", "catalog-100M-devices", "cluster-empty"])
def test_issue_19_cases_fail_fast_before_torch(argv, tmp_path):
    """The issue's three commands, as a user types them: exit 2, one line, and torch is never
    imported (the checks that reject them come first), so they fail in about a second."""
    code = ("import sys, runpy; sys.argv = ['hetsim'] + sys.argv[1:]\n"
            "try:\n    runpy.run_module('hetsim.search', run_name='__main__')\n"
            "finally:\n    sys.stdout.write('torch imported: %s\\n' % ('torch' in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code, *argv, "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert_one_error(p.returncode, p.stdout, p.stderr)
    assert "torch imported: False" in p.stdout


def test_storage_password_never_printed(tmp_path):
    url = "postgresql://alice:PASSWORD@db.invalid/hetsim"
    p = subprocess.run([sys.executable, "-m", "hetsim.search", "--model", "mlp", "--cluster", CLUSTER, "--out",
                        str(tmp_path), "--storage", url], cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = assert_one_error(p.returncode, p.stdout, p.stderr, "postgresql://alice:***@db.invalid/hetsim")
    assert "PASSWORD" not in p.stdout + p.stderr, line


def test_masked_url():
    from hetsim.search.study import hide_secrets, masked_url

    assert masked_url("postgresql://alice:PASSWORD@host/db") == "postgresql://alice:***@host/db"
    assert masked_url("postgresql://alice:p@ss@host/db") == "postgresql://alice:***@host/db"  # unescaped @
    assert masked_url("mysql://u:pw@h/db?password=pw&x=1") == "mysql://u:***@h/db?password=***&x=1"
    assert masked_url("sqlite:////tmp/a@b/x.db") == "sqlite:////tmp/a@b/x.db"  # no credentials: unchanged
    assert "hunter2" not in masked_url("weird:://u:hunter2@x")  # not parsable by SQLAlchemy
    assert masked_url("alice:hunter2@host/db") == "alice:***@host/db"  # the scheme forgotten
    assert hide_secrets("login for alice with hunter22 failed", "pg://alice:hunter22@h/db") == \
        "login for alice with *** failed"


def test_subprocess_cli_gives_the_same_one_line(tmp_path):
    """The real entry point, `python -m hetsim.search`, behaves like main()."""
    p = subprocess.run([sys.executable, "-m", "hetsim.search", "--model", "mlp", "--cluster", "emu:1.0@0G",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert_one_error(p.returncode, p.stdout, p.stderr, "'0G'")
