// Which family of kernels a device runs. The Hopper paths (thread-block clusters, bulk copies on
// mbarriers, programmatic dependent launch, the fused sm_90a products) run on compute capability
// 9.0; every other device takes the portable paths, which use nothing newer than sm_80 (one CTA
// per row, cp.async staging, cuBLASLt products). docs/architecture.md#devices lists them.
#pragma once

namespace xent::cuda {

// Whether `device` takes the Hopper paths: its compute capability is 9.0, the build holds sm_90
// code for it (not only sm_80 code compiled by the driver), both read once per device and
// cached, and the test hook does not force the portable paths. A process without a usable
// device answers true, so that plans made there (workspace queries on a CPU machine) are the
// Hopper plans, as before the portable tier existed.
bool hopper_paths(int device);
// The same for the calling thread's current device.
bool hopper_paths();

}  // namespace xent::cuda
