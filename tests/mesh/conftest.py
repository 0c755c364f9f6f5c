"""The fake-mesh suite: 4 CPU devices stand in for a GPU mesh.

XLA makes the devices when jax starts, from XLA_FLAGS=--xla_force_host_platform_device_count=4,
so the suite runs in a process of its own: tests/test_mesh.py starts it (JOA_MESH_SUITE=1 pytest
tests/mesh), and so may a developer. A plain run of tests/ leaves this folder out
(tests/conftest.py).
"""

from __future__ import annotations

import os
import sys

DEVICES = 4
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ helpers

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.device_count() < DEVICES:
        skip = pytest.mark.skip(reason=f"needs {DEVICES} devices (jax started before XLA_FLAGS "
                                       f"was set: run tests/mesh in a process of its own)")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(params=["shardy", pytest.param("gspmd", marks=pytest.mark.slow)])
def partitioner(request):
    """Both of jax's SPMD partitioners: Shardy (the default) and GSPMD (with `-m slow`)."""
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", True)
