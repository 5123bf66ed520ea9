#!/usr/bin/env bash
# The whole test suite: set-up (tools/setup.sh), build, then every test with ctest.
# Multi-process tests start their own mpirun / local SLURM; GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
BUILD=${DFLASH_BUILD_DIR:-build}
source tools/mpi_env.sh
cd "$BUILD"
ctest --output-on-failure --timeout 900 -j "$(nproc)" "$@"
