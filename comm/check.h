// The MPI and NCCL members of core/error.h's check-macro family: they throw CommError (exit 3)
// with the statement, file:line, rank and the library's own error string (for NCCL also
// ncclGetLastError, which names the failing peer). Only comm/ calls MPI and NCCL directly.
#pragma once

#include <mpi.h>

#include "core/error.h"

#ifdef DFLASH_CUDA
#include <nccl.h>
#endif

#define DFLASH_CHECK_MPI(stmt)                                                                \
  do {                                                                                        \
    int _dflash_rc = (stmt);                                                                  \
    if (_dflash_rc != MPI_SUCCESS) {                                                          \
      char _dflash_buf[MPI_MAX_ERROR_STRING];                                                 \
      int _dflash_len = 0;                                                                    \
      MPI_Error_string(_dflash_rc, _dflash_buf, &_dflash_len);                                \
      ::dflash::detail::throw_check_failed("MPI", #stmt, __FILE__, __LINE__,                  \
                                           std::string(_dflash_buf, _dflash_len));            \
    }                                                                                         \
  } while (0)

#ifdef DFLASH_CUDA
// NCCL: both ncclGetErrorString and ncclGetLastError (the latter names the failing peer).
#define DFLASH_CHECK_NCCL(stmt, comm)                                                         \
  do {                                                                                        \
    ncclResult_t _dflash_rc = (stmt);                                                         \
    if (_dflash_rc != ncclSuccess && _dflash_rc != ncclInProgress)                            \
      ::dflash::detail::throw_check_failed(                                                   \
          "NCCL", #stmt, __FILE__, __LINE__,                                                  \
          ::fmt::format("{} ({})", ncclGetErrorString(_dflash_rc), ncclGetLastError(comm)));  \
  } while (0)
#endif
