// Measures one case: xent and (optionally) the naive form, with agreement and ceilings.
#pragma once

#include <vector>

#include "bench/config.hpp"
#include "bench/device.hpp"
#include "bench/record.hpp"

namespace xent::bench {

struct MeasureSettings {
  int repeat = 5;
  int warmup = 1;
  bool naive = true;
  bool check = true;
  double copy_bandwidth = 0;      // B of this run (0 on the CPU)
  bool profile_one_call = false;  // see Config::profile_one_call
};

// Appends the records of this case (xent first, then naive). Failures of an implementation become
// records with an error; they never stop the run.
void measure_case(BenchDevice& device, const Case& c, const MeasureSettings& settings,
                  std::vector<Record>& records);

}  // namespace xent::bench
