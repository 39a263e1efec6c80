"""Shardings on 8 CPU devices: run in a subprocess, since the device count is
fixed when JAX starts."""

import os
import subprocess
import sys


def test_shardings_on_eight_devices():
    script = os.path.join(os.path.dirname(__file__), "_multidevice.py")
    # This checkout's filterjit, not an installed one.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-W", "error", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for check in (
        "check_in_shardings_prefix_skips_statics",
        "check_in_shardings_prefix_over_an_argument_holding_none",
        "check_outputs_keep_input_shardings",
        "check_a_constant_output_is_placed_as_jax_jit_places_it_after_a_nested_call",
        "check_out_shardings_prefix",
        "check_nested_in_shard_map_and_in_a_jit_over_a_mesh",
        "check_jit_shardings_are_jax_jits",
        "check_one_in_sharding_for_all_arguments",
        "check_data_parallel_training_matches_single_device",
    ):
        assert f"passed {check}" in result.stdout, result.stdout
