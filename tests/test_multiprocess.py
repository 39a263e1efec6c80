"""filter_jit in a multi-process JAX program: real processes joined by
`jax.distributed` on the loopback interface, each with two CPU devices, so that a
mesh spans four devices of which each process holds two.

The checks themselves are in `tests/multiprocess/checks.py`; `tests/_multiprocess.py`
starts the processes and never lets them hang. Most checks run in one launch of two
processes (start-up and the runtime's connection paid once), and each test reads
its check's result from both; the checks whose processes pass different static
values run in a launch of their own, as do the call made on one process alone and
the single-process reference for the training losses.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _multiprocess import (
    launch,
    LaunchError,
    port_refused,
    ProcessResult,
    skip_reason,
)
from helpers import one_device_sharding, subprocess_env

from filterjit._multiprocess import canonical, check_statics_agree, spans_processes


CHECKS = Path(__file__).resolve().parent / "multiprocess" / "checks.py"
TIMEOUT = 120.0  # seconds for one launch; a run here takes about 5
SHARED = [
    "check_training",
    "check_shardings_prefix",
    "check_donate",
    "check_statics_share_one_program",
    "check_statics_agree_direct",
    "check_nested_in_jit",
    "check_nested_in_shard_map",
    "check_lower_with_global_shardings",
    "check_shardings_prefix_over_none",  # last: its failure stops the launch
]
MISMATCHED = [
    "check_mismatched_static_through_filter_jit",
    "check_mismatched_statics_elsewhere",
]
needs_multiprocess = pytest.mark.skipif(
    skip_reason() is not None, reason=f"no multi-process CPU JAX: {skip_reason()}"
)
# The harness's own tests need a loopback port, and no JAX.
needs_a_port = pytest.mark.skipif(
    port_refused() is not None, reason=f"{port_refused()}"
)


# -- The harness itself: fast, no JAX program needed


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return path


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


@needs_a_port
def test_harness_collects_every_process_result(tmp_path):
    script = _script(
        tmp_path,
        """
        import json, os, sys
        with open(os.environ["FILTERJIT_MP_RESULT"], "w") as file:
            json.dump({
                "id": int(os.environ["FILTERJIT_MP_PROCESS_ID"]),
                "of": int(os.environ["FILTERJIT_MP_NUM_PROCESSES"]),
                "coordinator": os.environ["FILTERJIT_MP_COORDINATOR"],
                "xla_flags": os.environ["XLA_FLAGS"],
                "args": sys.argv[1:],
            }, file)
        """,
    )
    results = launch(script, ["a", "b"], num_processes=3, devices_per_process=4)
    assert [r.result["id"] for r in results] == [0, 1, 2]
    assert {r.result["of"] for r in results} == {3}
    assert all(r.result["args"] == ["a", "b"] for r in results)
    assert all(r.ok for r in results)
    coordinator = results[0].result["coordinator"]
    host, port = coordinator.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0, coordinator
    assert {r.result["coordinator"] for r in results} == {coordinator}
    flags = results[0].result["xla_flags"]
    assert flags == "--xla_force_host_platform_device_count=4"


@needs_a_port
def test_harness_kills_the_others_when_one_process_fails(tmp_path):
    # Process 1 fails; process 0 waits forever, as it would in a collective that
    # process 1 never joins.
    script = _script(
        tmp_path,
        """
        import os, sys, time
        if os.environ["FILTERJIT_MP_PROCESS_ID"] == "1":
            sys.exit("process 1 gives up")
        print("process 0 waits", flush=True)
        time.sleep(600)
        """,
    )
    started = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        launch(script, timeout=60, grace=0.5)
    assert time.perf_counter() - started < 30
    waiting, failed = info.value.results
    assert failed.returncode == 1 and "process 1 gives up" in failed.stderr
    assert waiting.returncode is None and "process 0 waits" in waiting.stdout
    assert _gone(waiting.pid) and _gone(failed.pid)
    message = str(info.value)
    assert "failed" in message and "process 1 gives up" in message, message
    assert "--- process 0: killed" in message, message


@needs_a_port
def test_harness_times_out_and_kills_the_whole_process_group(tmp_path):
    # Each process starts a child of its own that would outlive it.
    script = _script(
        tmp_path,
        """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("child", child.pid, flush=True)
        time.sleep(600)
        """,
    )
    started = time.perf_counter()
    with pytest.raises(LaunchError, match="timed out after 3 s") as info:
        launch(script, timeout=3)
    assert time.perf_counter() - started < 20
    for result in info.value.results:
        assert result.returncode is None
        child = int(result.stdout.split()[1])
        deadline = time.perf_counter() + 5  # init reaps the orphan
        while not _gone(child) and time.perf_counter() < deadline:
            time.sleep(0.05)
        assert _gone(result.pid) and _gone(child), result


# -- The statics check's pieces, in this process


def test_canonical_keeps_types_and_exact_values_apart():
    values = [1, 1.0, True, 0.0, -0.0, 1 + 0j, "1", b"1", None, (1,), [1], {1}]
    texts = [canonical(v) for v in values]
    assert len(set(texts)) == len(values), texts
    assert canonical(float("nan")) == canonical(-float("nan"))  # one NaN, as keyed
    assert canonical(jnp.sin) != canonical(jnp.cos)
    assert canonical([1, [2, 3]]) != canonical([1, [2, 4]])


class _Opaque:  # the default repr: an address
    def __init__(self, a):
        self.a = a


class _Unrepresentable:
    def __repr__(self):
        raise RuntimeError("no repr")


def test_canonical_of_awkward_values():
    assert canonical(_Opaque(1)) == canonical(_Opaque(1)) != canonical(_Opaque(2))
    assert "unrepresentable" in canonical(_Unrepresentable())
    cycle: list = []
    cycle.append(cycle)
    assert canonical(cycle) == "builtins.list(builtins.list:...)"
    nested: list = [0]
    for _ in range(100):
        nested = [nested]
    assert canonical(nested)  # depth-limited, not a RecursionError


_DIGESTS = """
import functools, json, sys
import equinox as eqx, jax
from filterjit._multiprocess import canonical, _digest
class Opaque:
    def __init__(self):
        self.a = {"x", "y", "z"}
class Net(eqx.Module):
    act: object = eqx.field(static=True)
values = [
    {"alpha", "beta", "gamma", "delta"}, frozenset(range(50)), lambda x: x,
    Opaque(), jax.nn.relu, functools.partial(max, 1), object(),
    jax.tree.structure(Net(jax.nn.relu)), jax.tree.structure(Net(jax.nn.gelu)),
    jax.tree.structure(eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))),
]
print(json.dumps([_digest(canonical(v)) for v in values]))
"""


@pytest.mark.slow
def test_canonical_is_equal_in_two_processes():
    # Fresh interpreters with different string-hash seeds and memory layouts, as
    # two processes of one program have.
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _DIGESTS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu"),
        )
        for seed in ("1", "2")
    ]
    outputs = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err
            outputs.append(json.loads(out))
    finally:
        for process in processes:
            process.kill()
            process.wait()
    first, second = outputs
    assert first == second
    assert first[7] != first[8]  # relu and gelu as static fields


def test_spans_processes_in_one_process():
    local = jnp.ones(3)
    assert not spans_processes([local, np.ones(2)], None, None)
    one_device = one_device_sharding(jax.devices()[0])
    assert not spans_processes([local], (one_device, None), one_device)
    traced = []
    jax.grad(lambda x: traced.append(spans_processes([x])) or x)(1.0)
    assert traced == [True]  # a tracer does not say where it lives


def test_check_statics_agree_is_silent_in_one_process():
    assert check_statics_agree("f", [("n", 1), ("broken", _Unrepresentable())]) is None


# -- filter_jit across processes


def _check(results: list[ProcessResult], name: str) -> list[Any]:
    """The result of check `name` on every process, after asserting that it ran
    and passed on every one."""
    values = []
    for process in results:
        record = (process.result or {}).get("checks", {})
        if name not in record:
            ran = list(record)
            raise AssertionError(
                f"{name} did not run on process {process.process_id} (ran: {ran})\n"
                + process.describe()
            )
        entry = record[name]
        assert entry["ok"], (
            f"{name} failed on process {process.process_id}:\n{entry.get('error')}"
        )
        values.append(entry["result"])
    return values


@pytest.fixture(scope="module")
def shared_run() -> list[ProcessResult]:
    """One launch of two processes running every check in SHARED, in order."""
    started = time.perf_counter()
    try:
        results = launch(CHECKS, SHARED, timeout=TIMEOUT)
    except LaunchError as error:  # each test reports its own check
        results = error.results
    _report(results, SHARED, time.perf_counter() - started)
    return results


def _report(results: list[ProcessResult], names: list[str], seconds: float) -> None:
    """Prints (shown with `pytest -s`) how long the launch and each check took."""
    print(f"\n2 processes x 2 devices, {len(names)} checks: {seconds:.1f} s")
    for name in names:
        entry = ((results[0].result or {}).get("checks") or {}).get(name) or {}
        print(f"  {name}: {entry.get('seconds')} s")


@needs_multiprocess
@pytest.mark.slow
def test_every_process_sees_the_whole_mesh(shared_run):
    for process in shared_run:
        assert process.result is not None, process.describe()
        assert process.result["process_count"] == 2
        assert process.result["device_count"] == 4
        assert process.result["local_device_count"] == 2
    assert [p.result["process_id"] for p in shared_run] == [0, 1]


@needs_multiprocess
@pytest.mark.slow
def test_data_parallel_training_matches_a_single_process(shared_run):
    parallel = _check(shared_run, "check_training")
    assert parallel[0]["losses"] == parallel[1]["losses"]  # one replicated value
    assert [p["devices"] for p in parallel] == [4, 4]
    (single,) = launch(
        CHECKS, ["check_training"], num_processes=1, devices_per_process=1
    )
    (reference,) = _check([single], "check_training")
    assert reference["devices"] == 1 and reference["processes"] == 1
    print("\nlosses, 2 processes x 2 devices:", parallel[0]["losses"])
    print("losses, 1 process x 1 device:   ", reference["losses"])
    np.testing.assert_allclose(parallel[0]["losses"], reference["losses"], rtol=1e-5)
    assert len(reference["losses"]) == 6


@needs_multiprocess
@pytest.mark.slow
def test_shardings_as_prefixes_of_arguments_and_output(shared_run):
    first, second = _check(shared_run, "check_shardings_prefix")
    assert first == second


@needs_multiprocess
@pytest.mark.slow
def test_a_sharding_prefix_over_an_argument_holding_none(shared_run):
    first, second = _check(shared_run, "check_shardings_prefix_over_none")
    assert first == second == {"total": 496.0}


@needs_multiprocess
@pytest.mark.slow
def test_donation(shared_run):
    first, second = _check(shared_run, "check_donate")
    assert (
        first
        == second
        == {
            "none": [False, False],
            "all": [True, True],
            "('batch',)": [False, True],
        }
    )


@needs_multiprocess
@pytest.mark.slow
def test_equal_statics_share_one_program(shared_run):
    assert _check(shared_run, "check_statics_share_one_program") == [{"traces": 3}] * 2


@needs_multiprocess
@pytest.mark.slow
def test_statics_agreement_check(shared_run):
    first, second = _check(shared_run, "check_statics_agree_direct")
    # Every process raised the same error.
    assert first["messages"] == second["messages"]
    assert len(first["messages"]) == 8
    print(f"\ncheck_statics_agree, statics equal: {first['seconds_when_equal']:.4f} s")
    assert first["seconds_when_equal"] < 1.0


@pytest.fixture(scope="module")
def mismatch_run() -> tuple[list[ProcessResult], float]:
    """One launch of two processes that pass different static values."""
    started = time.perf_counter()
    results = launch(CHECKS, MISMATCHED, timeout=TIMEOUT, check=False)
    seconds = time.perf_counter() - started
    _report(results, MISMATCHED, seconds)
    return results, seconds


@needs_multiprocess
@pytest.mark.slow
def test_a_static_that_differs_between_processes_is_an_error(mismatch_run):
    results, seconds = mismatch_run
    first, second = _check(results, "check_mismatched_static_through_filter_jit")
    assert first == second  # the same error on every process
    assert seconds < TIMEOUT


@needs_multiprocess
@pytest.mark.slow
def test_a_static_field_or_a_call_under_grad_that_differs_is_an_error(mismatch_run):
    results, _ = mismatch_run
    first, second = _check(results, "check_mismatched_statics_elsewhere")
    assert first == second
    assert set(first["messages"]) == {"static_field", "eager_grad"}


@needs_multiprocess
@pytest.mark.slow
def test_a_call_on_one_process_alone_does_not_wait_for_the_others():
    # Were process 0 to wait for the others, it would hang, and the harness kill it.
    results = launch(CHECKS, ["check_process_local_call"], timeout=60, check=False)
    first, second = _check(results, "check_process_local_call")
    assert first == {"out": 3.0} and second == {"out": None}


@needs_multiprocess
@pytest.mark.slow
def test_nested_in_jit_is_a_no_op(shared_run):
    first, second = _check(shared_run, "check_nested_in_jit")
    assert first == second


@needs_multiprocess
@pytest.mark.slow
def test_nested_in_shard_map_is_a_no_op(shared_run):
    first, second = _check(shared_run, "check_nested_in_shard_map")
    assert first == second


@needs_multiprocess
@pytest.mark.slow
def test_lower_with_global_shardings(shared_run):
    assert (
        _check(shared_run, "check_lower_with_global_shardings")
        == [{"partitions": 4}] * 2
    )
