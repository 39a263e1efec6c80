"""Shardings on 8 CPU devices: run in a subprocess, since the device count is
fixed when JAX starts. The subprocess asks for the CPU platform, so that these
run on any machine (with a GPU, JAX would choose it: one device)."""

import subprocess
import sys
from pathlib import Path

from helpers import subprocess_env, WARNINGS_AS_ERRORS


# What the subprocess needs: 8 devices of JAX's CPU platform.
EIGHT_CPU_DEVICES = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
}


def test_shardings_on_eight_devices():
    script = Path(__file__).parent / "_multidevice.py"
    # This checkout's filterjit, not an installed one.
    env = subprocess_env(**EIGHT_CPU_DEVICES)
    result = subprocess.run(
        [sys.executable, *WARNINGS_AS_ERRORS, str(script)],
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
