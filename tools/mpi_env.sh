# Environment for OpenMPI on one machine, as root, with more ranks than cores (CI, the demo).
# Sourced by tools/test.sh and tools/demo.sh; harmless on a cluster (only loopback settings).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
export OMPI_MCA_mpi_yield_when_idle=1
