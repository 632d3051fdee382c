"""Forked ranks must not inherit MKL's memory-manager locks (docs/real_processes.md)."""
import os
import subprocess
import sys


def _mkl_setting(env: dict) -> str:
    code = "import functional_pp, os; print(os.environ.get('MKL_DISABLE_FAST_MM'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return out.stdout.strip()


def test_importing_the_package_turns_mkls_memory_manager_off_unless_the_user_chose():
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    assert _mkl_setting(env) == "1"
    assert _mkl_setting({**env, "MKL_DISABLE_FAST_MM": "0"}) == "0"
