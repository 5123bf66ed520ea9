// The target -> drafter message of one batch, typed.
//
// Owns: BatchMessage (what a target sends for global batch k) and its one wire layout, the
// Communicator's tensor list (comm/communicator.h Message, kind kBatchMessageKind):
//   tensors[0] ids         [T] int64     the packed token stream
//   tensors[1] loss_mask   [T] uint8     1 where the token is trained on
//   tensors[2] cu_seqlens  [n+1] int64   document bounds in the stream (0 = cu[0] < ... = T)
//   tensors[3] features    [T, K*H]      the captured target layers (target dtype)
//   tensors[4] stats       [4] float64   {tokens, target busy seconds, target wait seconds, stop}
//                                        (stop: 1 if the target was signalled, roles/preempt.h)
// pack() and unpack() are the only code that knows the positions; unpack() checks kind, batch,
// count, dtypes and shapes and throws CommError naming the sender on a mismatch (a peer out
// of step or of another version). Tensors are moved, never copied, on both sides.
// Thread-safety: plain values and functions.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "comm/communicator.h"

namespace dflash::roles {

// Message kind of the target -> drafter stream.
constexpr int32_t kBatchMessageKind = 1;
constexpr int kNumBatchTensors = 5;

// What a target reports with each batch.
struct TargetStats {
  double tokens = 0, busy_s = 0, wait_s = 0;
  double stop = 0;  // 1: the target was signalled to stop (preempt.h)
};

struct BatchMessage {
  int64_t batch = -1;     // global batch index k
  at::Tensor ids;         // [T] int64
  at::Tensor loss_mask;   // [T] uint8
  at::Tensor cu_seqlens;  // [n+1] int64
  at::Tensor features;    // [T, K*H]
  TargetStats stats;
};

// The message of `b`; the stats travel as a float64 tensor on `device` (the communicator's).
comm::Message pack(const BatchMessage& b, at::Device device);

// The batch of a received message; CommError naming `from` unless it is batch
// `expected_batch` in the layout above. ids, loss_mask, cu_seqlens (and the stats) come back on
// the host (what the drafter's step reads there), the features on the communicator's device.
BatchMessage unpack(comm::Message msg, int64_t expected_batch, const std::string& from);

}  // namespace dflash::roles
