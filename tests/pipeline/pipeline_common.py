"""What the pipeline tests (test_e2e.py, test_e2e_targets.py, test_run_outputs.py, test_speed.py)
share: where the source tree and the build are, the dflash_rank binary, tools/ on the import path,
the environment of mpirun on one machine as root (tools/mpi_env.sh's settings), and the skip when
either is missing."""
import os
import shutil
import sys

SRC = os.environ.get("DFLASH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("DFLASH_BUILD_DIR", os.path.join(SRC, "build"))
RANK_BIN = os.path.join(BUILD, "trainer", "dflash_rank")
sys.path.insert(0, os.path.join(SRC, "tools"))

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_tcp_if_include="lo",
           OMPI_MCA_oob_tcp_if_include="lo", OMPI_MCA_mpi_yield_when_idle="1", PYTHONDONTWRITEBYTECODE="1")


def skip_without_rank_and_mpirun():
    """In a module fixture: skip the module when dflash_rank is not built or mpirun is missing."""
    import pytest
    if not os.path.exists(RANK_BIN):
        pytest.skip(f"{RANK_BIN} not built")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")
