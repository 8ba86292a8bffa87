// A side stream for the fused linear losses: the memory-bound row kernel of one chunk runs on it
// beside the compute-bound products of the previous chunk on the caller's stream. Fork and join
// go through events only, so the op stays free of host synchronisation and graph-capturable.
#pragma once

#include <cuda_runtime.h>

namespace xent::cuda {

// Whether the planner may grant two chunk buffers for overlap: XENT_LINEAR_OVERLAP=1 turns it on
// (read once; off by default because it measured no faster, see linear_streams.cu).
bool linear_overlap_enabled();

class SideStream {
 public:
  explicit SideStream(cudaStream_t main);
  ~SideStream();  // the caller's stream waits for everything issued on the side stream
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  cudaStream_t stream() const { return side_; }
  void fork();       // side stream waits for the work issued so far on the caller's stream
  void mark_done();  // marks the work issued so far on the side stream
  void wait_done();  // caller's stream waits for the last marked side-stream work

 private:
  cudaStream_t main_;
  cudaStream_t side_;
  cudaEvent_t forked_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

}  // namespace xent::cuda
