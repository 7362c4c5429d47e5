"""hetsim.hardware.hostalloc: every timing process fixes glibc's malloc thresholds, or says it did not."""

import subprocess
import sys

import pytest

CHECK = """
from hetsim.hardware import hostalloc
first = hostalloc.steady_malloc()
print(first, hostalloc.steady_malloc())
"""


def run(env_value: str | None) -> str:
    import os

    env = dict(os.environ)
    env.pop("HETSIM_MALLOC", None)
    if env_value is not None:
        env["HETSIM_MALLOC"] = env_value
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not glibc(), reason="mallopt is glibc's")
def test_sets_the_thresholds_once_on_glibc():
    assert run(None) == "True True"


def test_default_leaves_the_allocator_alone():
    assert run("default") == "False False"


def test_every_timing_process_asks_for_it():
    """The rank entry point, the profiler and the training loop call it before they time anything."""
    import inspect

    from hetsim.search.train import loop

    from hetsim.execution import worker
    from hetsim.profiling import obtain

    assert "steady_malloc()" in inspect.getsource(worker.run_job)
    assert "steady_malloc()" in inspect.getsource(obtain.measure_profiles)
    assert "steady_malloc()" in inspect.getsource(loop.Trainer.setup)
