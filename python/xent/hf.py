"""Hugging Face causal LMs whose training loss never materialises the (tokens × vocabulary) logits.

    model = AutoModelForCausalLM.from_config(config)
    xent.hf.patch(model)
    loss = model(input_ids, labels=labels).loss   # lm_head + loss fused: no logits tensor

The patched forward keeps the model's own loss semantics: labels are shifted by one (or
`shift_labels` taken as given), `ignore_index` (-100) rows are skipped, and with
`num_items_in_batch` (gradient accumulation in Trainer) the loss is the sum over valid tokens
divided by it; otherwise the mean over valid tokens. Gemma 2/3 `final_logit_softcapping` and the
logit scaling of Granite and Falcon-H1 are applied inside the fused loss; mixture-of-experts models
add their router load-balancing loss as their own forward does. Without labels (inference,
generation), or in eval mode by default, the original forward runs and returns logits.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from xent.functional import linear_cross_entropy

__all__ = ["patch", "unpatch", "SUPPORTED_ARCHITECTURES"]


class _Family(NamedTuple):
    """What a causal-LM class does between its decoder and its loss, beyond Llama's
    `lm_head(hidden)` then ForCausalLMLoss. Every class has `.model` (the decoder, returning hidden
    states first) and an nn.Linear `.lm_head`; a `final_logit_softcapping` in the config is applied
    for any of them."""

    # The factor the class multiplies its logits by (Granite divides by logits_scaling, Falcon-H1
    # multiplies by lm_head_multiplier): the loss takes it as logit_scale.
    logit_scale: Callable[[torch.nn.Module], float] = lambda model: 1.0
    # Mixture-of-experts classes add router_aux_loss_coef * load_balancing_loss_func(...) to the
    # loss when output_router_logits is on, and return it as aux_loss.
    router_aux_loss: bool = False


_DENSE = _Family()
_MOE = _Family(router_aux_loss=True)

# The classes whose forward this patch reproduces (transformers 5.x).
_FAMILIES = {
    "LlamaForCausalLM": _DENSE,
    "Llama4ForCausalLM": _DENSE,  # the text model (its experts add no auxiliary loss)
    "MistralForCausalLM": _DENSE,
    "MixtralForCausalLM": _MOE,
    "Qwen2ForCausalLM": _DENSE,
    "Qwen2MoeForCausalLM": _MOE,
    "Qwen3ForCausalLM": _DENSE,
    "Qwen3MoeForCausalLM": _MOE,
    "Qwen3NextForCausalLM": _MOE,
    "GemmaForCausalLM": _DENSE,
    "Gemma2ForCausalLM": _DENSE,
    "Gemma3ForCausalLM": _DENSE,
    "Phi3ForCausalLM": _DENSE,
    "PhiForCausalLM": _DENSE,  # its lm_head has a bias
    "Olmo2ForCausalLM": _DENSE,
    "Olmo3ForCausalLM": _DENSE,
    "OlmoeForCausalLM": _MOE,
    "GraniteForCausalLM": _Family(logit_scale=lambda model: 1.0 / model.config.logits_scaling),
    "GraniteMoeForCausalLM": _Family(
        logit_scale=lambda model: 1.0 / model.config.logits_scaling, router_aux_loss=True
    ),
    "GlmForCausalLM": _DENSE,
    "Glm4ForCausalLM": _DENSE,
    "SmolLM3ForCausalLM": _DENSE,
    "GptOssForCausalLM": _MOE,
    "Exaone4ForCausalLM": _DENSE,
    "HunYuanDenseV1ForCausalLM": _DENSE,
    "HunYuanMoEV1ForCausalLM": _DENSE,  # no auxiliary loss in its forward
    "FalconH1ForCausalLM": _Family(logit_scale=lambda model: float(model.model.lm_head_multiplier)),
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)

_ORIGINAL = "_xent_original_forward"


def _softcap_of(config: Any) -> float | None:
    softcap = getattr(config, "final_logit_softcapping", None)
    return float(softcap) if softcap else None


def _check_model(model: torch.nn.Module, strict: bool) -> None:
    name = type(model).__name__
    if name in SUPPORTED_ARCHITECTURES:
        return
    layout = hasattr(model, "model") and isinstance(
        getattr(model, "lm_head", None), torch.nn.Linear
    )
    if strict or not layout:
        raise ValueError(
            f"xent.hf.patch: model unsupported: got {name}; expected one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (or strict=False for a model with the same "
            "layout: .model returning hidden states and an nn.Linear .lm_head)"
        )


def patch(
    model: torch.nn.Module,
    *,
    skip_logits: bool | None = None,
    workspace_bytes: int | None = None,
    fp32_logits: bool = False,
    strict: bool = True,
) -> torch.nn.Module:
    """Patches `model` (in place) so forward passes with labels use xent.linear_cross_entropy.

    skip_logits: None (default) fuses when labels are given and the model is in training mode;
    True fuses whenever labels are given; False never (the patch is then a no-op).
    The returned output has logits=None whenever the fused loss was used.
    Returns the model. Patching twice is a no-op; xent.hf.unpatch restores the original.
    """
    _check_model(model, strict)
    if hasattr(model, _ORIGINAL):
        return model
    original = model.forward
    names = [
        p.name
        for p in inspect.signature(original).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    options = dict(workspace_bytes=workspace_bytes, fp32_logits=fp32_logits)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if len(args) > len(names):
            raise TypeError(
                f"forward() takes {len(names)} positional arguments but {len(args)} were given"
            )
        kwargs.update(zip(names, args))
        has_labels = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        fuse = model.training if skip_logits is None else skip_logits
        if not (has_labels and fuse):
            return original(**kwargs)
        return _fused_forward(model, kwargs, options)

    setattr(model, _ORIGINAL, original)
    model.forward = forward
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Restores the forward that patch replaced; returns the model."""
    original = model.__dict__.pop(_ORIGINAL, None)
    if original is not None:
        del model.forward
    return model


def _fused_forward(model: torch.nn.Module, kwargs: dict, options: dict) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    family = _FAMILIES.get(type(model).__name__, _DENSE)
    labels = kwargs.pop("labels", None)
    logits_to_keep = kwargs.pop("logits_to_keep", 0)
    return_dict = kwargs.pop("return_dict", None)
    router_logits = False
    if family.router_aux_loss:
        router_logits = kwargs.get("output_router_logits")
        if router_logits is None:
            router_logits = getattr(model.config, "output_router_logits", False)
        kwargs["output_router_logits"] = router_logits
    # Everything else goes to the decoder exactly as the original forward passes it (it also
    # receives num_items_in_batch, ignore_index and shift_labels there, and ignores them).
    outputs = model.model(**kwargs)
    hidden = outputs[0]
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    hidden = hidden[:, keep, :]

    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        # As ForCausalLMLoss: position t predicts labels[t + 1]; the last position predicts nothing.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    num_items_in_batch = kwargs.get("num_items_in_batch")
    reduction = "sum" if num_items_in_batch is not None else "mean"
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(hidden.device)
    head = model.lm_head
    # The sum divided by num_items_in_batch inside the op: the gradients are formed for it in the
    # forward, so the backward has an upstream gradient of 1 and moves no bytes.
    loss = linear_cross_entropy(
        hidden,
        head.weight,
        shift_labels.to(hidden.device),
        head.bias,
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=_softcap_of(model.config),
        normalizer=num_items_in_batch,
        logit_scale=family.logit_scale(model),
        **options,
    )

    common = dict(
        loss=loss,
        logits=None,
        past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )
    if family.router_aux_loss:
        aux_loss = _router_aux_loss(model, outputs, kwargs) if router_logits else None
        if torch.is_tensor(aux_loss):
            loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
            common["loss"] = loss
        result = MoeCausalLMOutputWithPast(
            **common, aux_loss=aux_loss, router_logits=getattr(outputs, "router_logits", None)
        )
    else:
        result = CausalLMOutputWithPast(**common)
    if return_dict is False:
        return result.to_tuple()
    return result


def _router_aux_loss(model: torch.nn.Module, outputs: tuple, kwargs: dict) -> torch.Tensor | None:
    """The load-balancing loss of a mixture-of-experts class, by the function its own module
    defines (each family keeps a copy of its own)."""
    if getattr(outputs, "router_logits", None) is None:
        return None  # a decoder that returns none (GraniteMoe in transformers 5.17)
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    return balance(
        outputs.router_logits,
        model.num_experts,
        model.num_experts_per_tok,
        kwargs.get("attention_mask"),
    )
