// The whole public API of xent.
#pragma once

#include "xent/ce.hpp"
#include "xent/distill.hpp"
#include "xent/distill_shard.hpp"
#include "xent/linear_ce.hpp"
#include "xent/linear_distill.hpp"
#include "xent/linear_policy.hpp"
#include "xent/scale.hpp"
#include "xent/shard.hpp"
#include "xent/types.hpp"
