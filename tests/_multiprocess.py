"""A harness that runs a script in N real Python processes of one JAX program.

`launch(script, args)` starts `num_processes` processes of `script`, each with
`devices_per_process` CPU devices, and hands each the coordinates of a
`jax.distributed` program on a free loopback port through the environment. The
script calls `tests/multiprocess/worker.py`'s `initialize()` first, and writes its
result as JSON to the file named by `FILTERJIT_MP_RESULT` (the worker's
`run_checks` does both).

It never hangs: every process runs in its own process group, all of which are
killed when the launch's timeout passes, shortly after the first process fails, or
when the caller is interrupted. Only loopback addresses are used: the coordinator
binds to 127.0.0.1, and the worker pins gloo's collectives there too.
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from helpers import subprocess_env, WARNINGS_AS_ERRORS


TESTS = Path(__file__).resolve().parent
WORKER_DIR = TESTS / "multiprocess"
LOOPBACK = "127.0.0.1"
# After the first process fails, how long the others get to fail on their own (with
# their own error messages) before they are killed.
GRACE_S = 10.0


class LaunchError(AssertionError):
    """A process failed, or the launch timed out. The message holds the exit
    status and the end of the output of every process."""

    def __init__(self, message: str, results: "list[ProcessResult]"):
        super().__init__(message)
        self.results = results


@dataclasses.dataclass
class ProcessResult:
    process_id: int
    pid: int
    returncode: int | None  # None: killed by the harness (timeout or a peer failed)
    stdout: str
    stderr: str
    result: Any  # what the process wrote to FILTERJIT_MP_RESULT, parsed, or None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self, tail: int = 3000) -> str:
        status = "killed" if self.returncode is None else f"exit {self.returncode}"
        out = self.stdout[-tail:].rstrip()
        err = _without_runtime_logs(self.stderr)[-tail:].rstrip()
        return (
            f"--- process {self.process_id}: {status} after {self.seconds:.1f} s\n"
            f"stdout:\n{out}\nstderr:\n{err}"
        )


def _without_runtime_logs(text: str) -> str:
    # The distributed runtime and gloo log every connection; keep the rest.
    noise = ("[Gloo]", "I0000", "W0000", "E0000")
    kept = [line for line in text.splitlines() if not line.startswith(noise)]
    return "\n".join(kept)


def skip_reason() -> str | None:
    """Why this platform cannot run a multi-process CPU program, or `None`."""
    if sys.platform == "win32":
        return "jax.distributed with CPU collectives is not supported on Windows"
    try:
        from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]
    except ImportError as error:
        return f"jaxlib's internals moved ({error}); cannot check for gloo"
    if not hasattr(_jax, "make_gloo_tcp_collectives"):
        return "this jaxlib is built without gloo CPU collectives"
    return port_refused()


def port_refused() -> str | None:
    """Why no port can be bound on the loopback interface (a sandbox without
    sockets, say), or `None`: the harness hands each launch one."""
    try:
        free_port()
    except OSError as error:
        return f"cannot bind a port on {LOOPBACK}: {error}"
    return None


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def launch(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    num_processes: int = 2,
    devices_per_process: int = 2,
    timeout: float = 120.0,
    check: bool = True,
    env: dict[str, str] | None = None,
    python_flags: Sequence[str] = WARNINGS_AS_ERRORS,
    grace: float = GRACE_S,
) -> list[ProcessResult]:
    """Runs `script args` in `num_processes` processes of one JAX program.

    **Arguments:**

    - `script`: a Python file; it must call the worker's `initialize()` before any
      JAX computation.
    - `num_processes`: 1 runs a single process without `jax.distributed`.
    - `devices_per_process`: CPU devices in each process (`XLA_FLAGS`).
    - `timeout`: seconds for the whole launch, after which every process is killed.
    - `check`: raise `LaunchError` unless every process exits with status 0.
    - `env`: extra environment variables for every process.
    - `python_flags`: flags for the interpreter; by default warnings are errors.
    - `grace`: after the first process fails, seconds the others get to finish
      (and print their own errors) before they are killed.

    **Returns:**

    One `ProcessResult` per process, in process order.
    """
    port = free_port()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="filterjit-mp-") as tmp:
        processes: list[subprocess.Popen[bytes]] = []
        files = []
        ended: dict[int, float] = {}
        timed_out = False
        try:
            for i in range(num_processes):
                process_env = {
                    **subprocess_env(),
                    **(env or {}),
                    "XLA_FLAGS": (
                        f"--xla_force_host_platform_device_count={devices_per_process}"
                    ),
                    "JAX_PLATFORMS": "cpu",
                    "FILTERJIT_MP_COORDINATOR": f"{LOOPBACK}:{port}",
                    "FILTERJIT_MP_NUM_PROCESSES": str(num_processes),
                    "FILTERJIT_MP_PROCESS_ID": str(i),
                    "FILTERJIT_MP_RESULT": os.path.join(tmp, f"result-{i}.json"),
                }
                # Proxies can make the runtime's gRPC connections hang.
                for name in list(process_env):
                    if name.lower() in ("http_proxy", "https_proxy", "all_proxy"):
                        del process_env[name]
                stdout = open(os.path.join(tmp, f"stdout-{i}"), "w+b")
                stderr = open(os.path.join(tmp, f"stderr-{i}"), "w+b")
                files.append((stdout, stderr))
                processes.append(
                    subprocess.Popen(
                        [sys.executable, *python_flags, str(script), *args],
                        stdout=stdout,
                        stderr=stderr,
                        stdin=subprocess.DEVNULL,
                        env=process_env,
                        start_new_session=True,  # its own group, killed as one
                    )
                )
            deadline = started + timeout
            first_failure: float | None = None
            while True:
                now = time.perf_counter()
                for i, process in enumerate(processes):
                    if i not in ended and process.poll() is not None:
                        ended[i] = now - started
                        if process.returncode != 0 and first_failure is None:
                            first_failure = now
                if len(ended) == len(processes):
                    break
                if now > deadline:
                    timed_out = True
                    break
                if first_failure is not None and now > first_failure + grace:
                    break
                time.sleep(0.02)
        finally:
            for process in processes:
                _kill(process)
        results = []
        for i, (stdout, stderr) in enumerate(files):
            stdout.seek(0)
            stderr.seek(0)
            out = stdout.read().decode("utf-8", "replace")
            err = stderr.read().decode("utf-8", "replace")
            stdout.close()
            stderr.close()
            path = Path(tmp) / f"result-{i}.json"
            try:
                result = json.loads(path.read_text()) if path.exists() else None
            except ValueError:
                result = None
            returncode = processes[i].returncode if i in ended else None
            seconds = ended.get(i, time.perf_counter() - started)
            pid = processes[i].pid
            results.append(ProcessResult(i, pid, returncode, out, err, result, seconds))
    if check and not all(r.ok for r in results):
        what = f"timed out after {timeout:.0f} s" if timed_out else "failed"
        details = "\n".join(r.describe() for r in results)
        raise LaunchError(
            f"{num_processes} processes of {Path(script).name} {' '.join(args)}: "
            f"{what}\n{details}",
            results,
        )
    return results
