"""The process side of `tests/_multiprocess.py`: join the JAX program the harness
describes in the environment, run named checks, write their results as JSON.

    initialize()                      # before any JAX computation
    run_checks({"check_x": check_x})  # runs those named on the command line
"""

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any


LOOPBACK = "127.0.0.1"


def _pin_gloo_to_loopback() -> None:
    """Makes gloo listen on 127.0.0.1, not on whatever the host name resolves to.

    JAX has no public option for gloo's address, so this registers the CPU backend
    again with gloo's collectives made for the loopback interface. It must run
    after `jax.distributed.initialize` and before the first computation.
    """
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]

    def make_cpu_client() -> Any:
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname=LOOPBACK
        )
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory(
        "cpu", make_cpu_client, priority=0, fail_quietly=False
    )


def initialize() -> tuple[int, int]:
    """Joins the program: returns `(process_id, num_processes)`.

    A single process (`FILTERJIT_MP_NUM_PROCESSES=1`, or no harness) runs without
    `jax.distributed`.
    """
    import jax

    num_processes = int(os.environ.get("FILTERJIT_MP_NUM_PROCESSES", "1"))
    process_id = int(os.environ.get("FILTERJIT_MP_PROCESS_ID", "0"))
    if num_processes > 1:
        address = os.environ["FILTERJIT_MP_COORDINATOR"]
        assert address.startswith(LOOPBACK + ":"), address
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=num_processes,
            process_id=process_id,
            coordinator_bind_address=address,
            initialization_timeout=60,
        )
        _pin_gloo_to_loopback()
    assert jax.process_count() == num_processes, jax.process_count()
    return process_id, num_processes


def _all_ok(ok: bool) -> bool:
    """Whether the check passed on every process (a collective)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return ok
    flags = multihost_utils.process_allgather(np.array([ok], np.int32))
    return bool(np.asarray(flags).all())


def run_checks(
    checks: Mapping[str, Callable[[], Any]], names: list[str] | None = None
) -> None:
    """Runs the checks named on the command line (all if none), in that order,
    timing each, and writes after each one what is known so far:

        {"process_id", "process_count", "device_count", "local_device_count",
         "checks": {name: {"ok", "seconds", "result", "error"}}}

    After each check the processes agree on whether it passed everywhere; if not,
    all stop there, so that no process waits in a collective the others never
    reach. Exits with status 1 if a check failed here, 2 if only elsewhere.
    """
    import jax

    names = names if names is not None else (sys.argv[1:] or list(checks))
    unknown = [name for name in names if name not in checks]
    assert not unknown, f"unknown checks {unknown}; known: {list(checks)}"
    record: dict[str, Any] = {
        "process_id": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "checks": {},
    }
    path = os.environ.get("FILTERJIT_MP_RESULT")

    def write() -> None:
        if path:
            with open(path + ".tmp", "w") as file:
                json.dump(record, file, indent=1, default=repr)
            os.replace(path + ".tmp", path)

    write()
    for name in names:
        started = time.perf_counter()
        entry: dict[str, Any] = {"ok": False, "seconds": None, "result": None}
        record["checks"][name] = entry
        try:
            entry["result"] = checks[name]()
            entry["ok"] = True
        except Exception:
            entry["error"] = traceback.format_exc()
            print(f"FAILED {name}\n{entry['error']}", file=sys.stderr, flush=True)
        entry["seconds"] = round(time.perf_counter() - started, 3)
        write()
        if not _all_ok(entry["ok"]):
            sys.exit(1 if not entry["ok"] else 2)
        print(f"passed {name} in {entry['seconds']:.2f} s", flush=True)
