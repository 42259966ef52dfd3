"""Suite-wide settings: Hypothesis draws fresh random inputs on every run, and a red run can be replayed.

* Profile ``moe_compile`` (loaded by default; ``HYPOTHESIS_PROFILE=<name>`` picks another): ``print_blob``
  (a failure prints ``@reproduce_failure(...)`` for its example), no deadline (the CPU may be shared),
  random (not derandomised) inputs. Profile ``derandomize``: the same inputs on every run.
* One seed per session: unless ``--hypothesis-seed=N`` is given, a fresh seed is drawn and every Hypothesis
  test runs from it (pytest-xdist's workers too: they inherit it through ``MOE_COMPILE_HYPOTHESIS_SEED``); the
  summary names it when a test failed, and ``--hypothesis-seed=N`` replays that run.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, core, settings

settings.register_profile(
    "moe_compile", print_blob=True, deadline=None, derandomize=False, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("derandomize", parent=settings.get_profile("moe_compile"), derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "moe_compile"))

# Inductor compiles in this process, not in a pool of compile workers: on the 2 cores of CI every core already runs a
# test, and each process that compiles (the pytest-xdist workers, every rank of a distributed test) would start its
# own pool of Python processes. tests/models/test_ep.py on 2 cores: 200 s -> 122 s. The generated code is the same.
# The environment reaches the subprocesses the tests start; the config, a process that imported Inductor already.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if "torch._inductor.config" in sys.modules:
    sys.modules["torch._inductor.config"].compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])

# Inductor's on-disk caches (FX graph, AOTAutograd) live in a directory of this run's own: a hit serves compiled code
# without running the passes (NOTE [cached compiles] (moe_compile/report.py)), and a cache an earlier run left on the
# machine made two record-checking tests see no records on CI. The pytest-xdist workers inherit the directory.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe_compile_tests_inductor_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

# Every compile in the suite validates its rewrites, validate=False included, and again each time (no verdict kept
# from an earlier test: tests patch kernels and passes under unchanged graphs); a refusal shows as a warning and a
# validation_failed record that the tests' report checks see.
os.environ.setdefault("MOE_COMPILE_VALIDATE_ALL", "1")
os.environ.setdefault("MOE_COMPILE_VERDICT_CACHE", "0")

_SESSION_SEED: list[int] = []
_SEED_ENV = "MOE_COMPILE_HYPOTHESIS_SEED"


def pytest_addoption(parser) -> None:
    parser.addoption("--family-records", default=None, metavar="PATH",
                     help="write the passes' records of every family the family matrix runs to PATH (JSON), to "
                          "compare two commits with `python -m tests.models.family_records --compare`")


def pytest_configure(config) -> None:
    if config.getoption("hypothesis_seed", None) is None and not settings.default.derandomize:
        # pytest-xdist's workers (-n 2) start after this hook and inherit the environment: one seed for the run
        seed = int(os.environ.get(_SEED_ENV) or random.SystemRandom().randrange(2**32))
        os.environ[_SEED_ENV] = str(seed)
        core.global_force_seed = seed
        _SESSION_SEED.append(seed)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _SESSION_SEED and terminalreporter.stats.get("failed"):
        terminalreporter.write_line(
            f"hypothesis: this run drew its examples from --hypothesis-seed={_SESSION_SEED[0]} (pass it to replay)"
        )


@pytest.fixture(scope="module")
def fake_group():
    """A fake process group of 2 ranks, this process rank 0: collectives trace and run, but move no data."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
