r"""Data-parallel training across processes with a `filter_jit` step.

Run as is, it starts two local processes of itself, each with two CPU devices,
joined by `jax.distributed` on 127.0.0.1: one program over a mesh of four devices.
Each process feeds its own half of every batch; the parameters are replicated. It
then trains the same model in this process on one device, and prints both losses.

    python examples/multi_process.py

On real hosts, run one process per host, each with its own `--process-id`:

    python examples/multi_process.py --coordinator HOST0:PORT --num-processes N \
        --process-id I
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


STEPS = 8
BATCH = 64  # rows per step, over all processes


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--coordinator", help="HOST:PORT of process 0")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--devices-per-process", type=int, default=2)
    return parser.parse_args()


def train(process_id: int, num_processes: int) -> tuple[list[float], int]:
    """Trains for STEPS steps; returns the losses and the number of traces of the
    step. The same code runs in one process or in many."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import filterjit
    from filterjit import filter_jit

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    replicated = NamedSharding(mesh, P())
    by_data = NamedSharding(mesh, P("data"))

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    # The model and the optimiser's state are made replicated below: `None` keeps
    # them as they are. The batch arrives sharded by rows.
    @filter_jit(
        donate=("model", "opt_state"),
        in_shardings=(None, None, by_data, by_data, None),
        out_shardings=replicated,
    )
    def step(model, opt_state, x, y, optimiser):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimiser.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    def replicate(tree):
        # Every process holds the same values: a replicated global array.
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(replicated, np.asarray(x)),
            tree,
        )

    model = eqx.nn.MLP(4, 1, width_size=32, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    model = eqx.combine(replicate(params), static)
    optimiser = optax.adam(1e-2)  # static: its functions are compiled in
    opt_state = replicate(optimiser.init(eqx.filter(model, eqx.is_array)))

    rng = np.random.default_rng(0)
    rows = BATCH // num_processes
    mine = slice(process_id * rows, (process_id + 1) * rows)
    losses = []
    for _ in range(STEPS):
        # Every process draws the same global batch here, to compare with one
        # process; a real loader reads only this process's rows.
        x = rng.uniform(-2.0, 2.0, (BATCH, 4)).astype(np.float32)
        y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
        x_global = jax.make_array_from_process_local_data(by_data, x[mine], x.shape)
        y_global = jax.make_array_from_process_local_data(by_data, y[mine], y.shape)
        model, opt_state, loss = step(model, opt_state, x_global, y_global, optimiser)
        losses.append(float(loss))  # replicated: every process holds it
    return losses, filterjit.num_traces(step)


def on_loopback(address: str) -> bool:
    return address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost")


def gloo_on_loopback() -> None:
    """For the local run only: makes gloo's collectives listen on 127.0.0.1 rather
    than on the address the host name resolves to. JAX has no public option for
    this, so it goes through private API, and is skipped if that has moved."""
    try:
        from jax._src import distributed, xla_bridge
        from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]

        client = distributed.global_state.client
        make_collectives = _jax.make_gloo_tcp_collectives
    except (ImportError, AttributeError):
        return

    def make_cpu_client():
        collectives = make_collectives(distributed_client=client, hostname="127.0.0.1")
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0)


def worker(args: argparse.Namespace) -> None:
    """One process of the program."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    local = on_loopback(args.coordinator)
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        # By default the coordinator listens on every interface.
        coordinator_bind_address=args.coordinator if local else None,
    )
    if local:
        gloo_on_loopback()
    losses, traces = train(args.process_id, args.num_processes)
    report = {"losses": losses, "traces": traces, "devices": jax.device_count()}
    print("RESULT " + json.dumps(report), flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(args: argparse.Namespace, timeout: float = 120.0) -> list[dict]:
    """Starts the processes of the program on this machine; returns what each
    reported. Kills them all if one fails or the timeout passes."""
    coordinator = f"127.0.0.1:{free_port()}"
    devices = args.devices_per_process
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
    }
    with tempfile.TemporaryDirectory() as tmp:
        logs = [
            open(os.path.join(tmp, f"{i}.log"), "w+") for i in range(args.num_processes)
        ]
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    f"--coordinator={coordinator}",
                    f"--num-processes={args.num_processes}",
                    f"--process-id={i}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            for i, log in enumerate(logs)
        ]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in processes):
                failed = any(p.returncode for p in processes)
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for process in processes:
                process.kill()
                process.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    if any(p.returncode for p in processes):
        why = "timed out" if time.monotonic() > deadline else "failed"
        raise SystemExit(f"the processes {why}:\n" + "\n".join(outputs))
    return [
        json.loads(line.removeprefix("RESULT "))
        for out in outputs
        for line in out.splitlines()
        if line.startswith("RESULT ")
    ]


def main() -> None:
    args = parse()
    if args.process_id is not None:
        worker(args)
        return
    reports = launch_local(args)
    n, d = args.num_processes, args.devices_per_process
    print(f"{n} processes x {d} CPU devices: a batch of {BATCH} rows over {n * d}")
    assert all(report["losses"] == reports[0]["losses"] for report in reports)
    single, _ = train(0, 1)  # this process: no jax.distributed, one device
    parallel = reports[0]["losses"]
    print(f"step  loss ({n} processes)  loss (1 process)")
    for i, (a, b) in enumerate(zip(parallel, single)):
        print(f"{i:4}  {a:18.4f}  {b:16.4f}")
    agree = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(parallel, single))
    print(f"losses agree to a relative 1e-5: {agree}")
    traces = {report["traces"] for report in reports}
    print(f"traces of step on each process: {', '.join(map(str, sorted(traces)))}")


if __name__ == "__main__":
    main()
