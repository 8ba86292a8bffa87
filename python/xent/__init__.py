"""xent: memory-efficient loss kernels for training language models.

    import xent
    loss = xent.cross_entropy(logits, target)                       # (N, V) or (B, T, V)
    loss = xent.linear_cross_entropy(hidden, lm_head.weight, target)  # never holds N x V logits
    logp, entropy = xent.linear_logprobs(hidden, lm_head.weight, target, temperature=0.7,
                                         return_entropy=True)       # RL: both differentiable
    loss = xent.policy_loss(logits, target, advantages, old_logprobs=old, clip_high=0.28)

Modules live in xent.nn, the Hugging Face patch in xent.hf.
"""

import torch

from xent import (  # noqa: E402  (hf imports transformers only when used)
    _ops,  # noqa: F401  (loads the compiled ops first)
    hf,
    nn,
)
from xent._build import build_info
from xent._build import check_gpus as _check_gpus
from xent._build import check_torch as _check_torch
from xent._build import source_version as _source_version
from xent.functional import (
    DISTILL_KINDS,
    KL_ESTIMATORS,
    POLICY_AGGREGATIONS,
    POLICY_LOSS_TYPES,
    TOPK_MASSES,
    CrossEntropyResult,
    PolicyLossResult,
    TopK,
    cross_entropy,
    distill,
    linear_cross_entropy,
    linear_distill,
    linear_logprobs,
    linear_policy_loss,
    logprobs,
    policy_loss,
)

__version__ = build_info()["version"] or _source_version()

_check_torch()
_check_gpus()

__all__ = [
    "CrossEntropyResult",
    "DISTILL_KINDS",
    "KL_ESTIMATORS",
    "POLICY_AGGREGATIONS",
    "POLICY_LOSS_TYPES",
    "PolicyLossResult",
    "TOPK_MASSES",
    "TopK",
    "build_info",
    "check_errors",
    "cross_entropy",
    "distill",
    "linear_cross_entropy",
    "hf",
    "linear_distill",
    "linear_logprobs",
    "linear_policy_loss",
    "logprobs",
    "nn",
    "policy_loss",
]


def check_errors(device: torch.device | None = None) -> None:
    """Raises the error a CUDA kernel flagged (an out-of-range target) since the last check.

    Kernels never synchronise with the host: a bad target on the GPU yields a NaN loss row and
    sets a device-side flag; this call synchronises the current stream and reports it with the
    message the CPU backend raises at once. A no-op on the CPU.
    """
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda":
        _ops.ops.check_errors(torch.empty(0, device=device))
