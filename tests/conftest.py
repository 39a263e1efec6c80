"""Settings for the whole suite, and its two tiers.

`python -m pytest` runs the default tier: every contract point, with a few
Hypothesis examples per property (25, or 5 where each example compiles:
`helpers.property_settings`). `python -m pytest --full` also runs the tests
marked `slow` (the code on the docs pages, the slow examples) and the properties
with 200 examples; `.ci/run` runs that. Both spread the test files over xdist
workers (pyproject.toml's addopts), and both run on the host's CPU whatever
accelerator the machine has: one process at a time can hold a TPU chip, and the
workers and the Python children the tests start would race for it.

`python -m pytest --device` runs the device tier instead: the tests of
`DEVICE_FILES` (those whose behaviour depends on the backend: the contract
matrix, the fast path, donation, asynchronous dispatch, runtime checks, AOT
stages, export), in this one process, on JAX's default backend (a TPU or GPU
where there is one). The children those tests start still run on the CPU.
"""

import os
import warnings
from collections.abc import Iterator

import hypothesis
import jax
import pytest


# Strict promotion catches silent dtype changes that a wrapper could introduce.
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Examples per property test, where the test does not set its own.
hypothesis.settings.register_profile("filterjit-default", max_examples=25)
hypothesis.settings.register_profile("filterjit-full", max_examples=200)


# The device tier: the test files whose results depend on the backend.
DEVICE_FILES = frozenset(
    {
        "test_aot.py",
        "test_composition.py",
        "test_donation.py",
        "test_export.py",
        "test_fastpath.py",
        "test_leaf_kinds.py",
        "test_misuse_errors.py",
        "test_outputs.py",
        "test_static_outputs_and_runtime_checks.py",
    }
)


# The test files of nested calls, run under `jax.checking_leaks()` (which collects
# garbage at the end of every trace: about twice a trace's time, too much for the
# whole tier).
LEAK_CHECKED_FILES = frozenset(
    {
        "test_composition.py",
        "test_containers_handed_back.py",
        "test_fuzz_programs.py",
        "test_leaf_kinds.py",
        "test_one_trace_across_levels.py",
        "test_outputs.py",
        "test_structure.py",
    }
)


@pytest.fixture(autouse=True)
def _no_tracer_outlives_its_trace(
    request: pytest.FixtureRequest,
) -> Iterator[None]:
    """The tests of nested calls (`LEAK_CHECKED_FILES`) run under
    `jax.checking_leaks()`: a tracer that a trace leaves behind (in a cache, a
    record of the call, a container) fails them. Tests marked `leaks_unchecked`
    run without: JAX's leak checker breaks what they test (an Equinox runtime
    check that fails raises an `IndexError` under it, with or without
    filterjit)."""
    checked = request.node.path.name in LEAK_CHECKED_FILES
    if not checked or request.node.get_closest_marker("leaks_unchecked"):
        yield
        return
    with jax.checking_leaks():
        yield


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the slow tier (tests marked slow), and the property tests "
        "with many examples",
    )
    parser.addoption(
        "--device",
        action="store_true",
        help="run the device tier alone: the tests whose results depend on the "
        "backend, in one process, on JAX's default backend (a TPU or GPU where the "
        "machine has one)",
    )


def _keep_to_the_cpu() -> None:
    """Keeps this process, the workers it starts and their children on the CPU."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")


def _open_the_device(config: pytest.Config) -> None:
    """Runs this process's tests on JAX's default backend, in this process alone
    (one process at a time can hold a TPU chip), and keeps its children off it."""
    config.option.numprocesses = 0
    config.option.dist = "no"
    config.option.tx = []
    # The backend's start-up warnings (a TPU's, say) are no test's subject.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jax.devices()
    os.environ["JAX_PLATFORMS"] = "cpu"  # read by the children's JAX only


def _check_filterjits_annotations() -> None:
    """Checks the annotations of filterjit's functions and methods on every call,
    in this process (beartype's import hook on the package, before it is
    imported): in each leg of the matrix, against what each version of JAX hands
    it. A violation raises jaxtyping's `TypeCheckError`, a `TypeError`, as under
    jaxtyping's import hook, which checked the same with beartype at about a third
    more CPU time per test (filterjit's annotations hold no array shapes for it to
    read)."""
    from beartype import BeartypeConf
    from beartype.claw import beartype_package
    from jaxtyping import TypeCheckError

    conf = BeartypeConf(claw_is_pep526=False, violation_type=TypeCheckError)
    beartype_package("filterjit", conf=conf)


# Where the run's processes keep the programs they compile (_share_compiled_programs),
# and, in the process that made it, to remove it at the end.
_COMPILED = "FILTERJIT_TESTS_COMPILED"
_CACHE_OWNER = pytest.StashKey[str]()


def _share_compiled_programs(config: pytest.Config) -> None:
    """The processes of this run (this one and its xdist workers) keep the programs
    they compile in one JAX persistent compilation cache, in a temporary directory
    removed at the end: a program compiled again (the same by another test, or a
    decorated function's and its undecorated reference's, which most tests compare)
    is loaded, not compiled. The Python children the tests start do not use it.
    Where JAX_COMPILATION_CACHE_DIR is set, JAX uses that one instead."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    if _COMPILED not in os.environ:  # the run's first process: it makes the cache
        import tempfile

        os.environ[_COMPILED] = tempfile.mkdtemp(prefix="filterjit-tests-compiled-")
        config.stash[_CACHE_OWNER] = os.environ[_COMPILED]
    jax.config.update("jax_compilation_cache_dir", os.environ[_COMPILED])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config: pytest.Config) -> None:
    cache = config.stash.get(_CACHE_OWNER, None)
    if cache is not None:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)
        del os.environ[_COMPILED]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    _check_filterjits_annotations()
    if config.getoption("--device"):
        _open_the_device(config)
    else:
        _keep_to_the_cpu()
    _share_compiled_programs(config)
    # Before collection, so that the settings the test modules build see it. An
    # explicit --hypothesis-profile wins.
    if config.getoption("hypothesis_profile", None) is None:
        full = config.getoption("--full")
        hypothesis.settings.load_profile(
            "filterjit-full" if full else "filterjit-default"
        )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if config.getoption("--device"):
        elsewhere = [item for item in items if item.path.name not in DEVICE_FILES]
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if item.path.name in DEVICE_FILES]
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="in the slow tier: run with --full")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
