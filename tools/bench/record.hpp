// One measurement: a row of the printed table and one object of the JSON array (docs/performance.md "What a
// benchmark record holds").
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "bench/config.hpp"
#include "bench/device.hpp"

namespace xent::bench {

struct Record {
  std::string impl;  // "xent" or "naive"
  Case spec;
  std::string device_name;
  TimeSummary time;
  double copy_bandwidth = 0;         // B, bytes/s; 0 when not measured
  double gemm_floor_ms = 0;          // F; 0 when not measured or not a linear op
  double ratio = NAN;                // min bytes / time / B (ce, distill) or time / F (linear)
  std::string ratio_kind;            // "bandwidth" or "gemm"
  std::size_t min_bytes = 0;         // bytes the bandwidth ratio counts
  std::size_t peak_extra_bytes = 0;  // beyond inputs and their gradients
  std::size_t workspace_bytes = 0;
  double loss_rel_err = NAN;  // against naive (xent records only)
  double grad_rel_err = NAN;  // largest over the gradients
  std::string error;          // non-empty: the measurement failed with this message
};

void print_table(const std::vector<Record>& records);
// Writes the records as a JSON array; throws std::runtime_error when the file cannot be written.
void write_json(const std::string& path, const std::vector<Record>& records);
// The commit of the checkout the bench was built from (run time first, then configure time).
std::string git_commit();

}  // namespace xent::bench
