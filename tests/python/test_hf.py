"""xent.hf.patch on tiny random-init Hugging Face causal LMs built from configs (no download):
loss and every parameter gradient equal to the unpatched model's."""

import copy

import pytest
import torch

import xent

transformers = pytest.importorskip("transformers")

VOCAB = 211  # odd on purpose
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


# Mixture-of-experts configs return their router logits, so the load-balancing loss is part of
# the loss compared (a large coefficient makes it count).
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.5)
MOE = dict(ROUTER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

# name -> (config class, arguments beyond COMMON): one per class of xent.hf.SUPPORTED_ARCHITECTURES.
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "llama4": (
        "Llama4TextConfig",
        dict(
            head_dim=8, num_local_experts=2, intermediate_size_mlp=64, interleave_moe_layer_step=2
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mixtral": (
        "MixtralConfig",
        dict(ROUTER, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_moe": ("Qwen2MoeConfig", dict(MOE, shared_expert_intermediate_size=16)),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(MOE, head_dim=8)),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(
            MOE,
            head_dim=8,
            shared_expert_intermediate_size=16,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
    "gemma": ("GemmaConfig", dict(head_dim=8)),
    # A small cap so the softcap changes the loss noticeably even at random init.
    "gemma2": (
        "Gemma2Config",
        dict(head_dim=8, final_logit_softcapping=0.5, query_pre_attn_scalar=8),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(head_dim=8, final_logit_softcapping=0.7, query_pre_attn_scalar=8),
    ),
    "phi3": ("Phi3Config", dict(pad_token_id=0)),
    "phi": ("PhiConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "olmo3": ("Olmo3Config", {}),
    "olmoe": ("OlmoeConfig", dict(ROUTER, num_experts=4, num_experts_per_tok=2)),
    "granite": ("GraniteConfig", dict(logits_scaling=4.0)),
    # transformers 5.17's GraniteMoe decoder returns no router logits (its own forward then fails
    # with output_router_logits), so only its logit scaling is compared.
    "granitemoe": (
        "GraniteMoeConfig",
        dict(logits_scaling=4.0, num_local_experts=4, num_experts_per_tok=2),
    ),
    "glm": ("GlmConfig", dict(head_dim=8, pad_token_id=0)),
    "glm4": ("Glm4Config", dict(head_dim=8, pad_token_id=0)),
    "smollm3": ("SmolLM3Config", dict(pad_token_id=0)),
    "gpt_oss": (
        "GptOssConfig",
        dict(ROUTER, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    ),
    "exaone4": ("Exaone4Config", dict(head_dim=8)),
    "hunyuan_dense": ("HunYuanDenseV1Config", dict(head_dim=8)),
    "hunyuan_moe": ("HunYuanMoEV1Config", dict(head_dim=8, num_experts=4, moe_topk=2)),
    "falcon_h1": (
        "FalconH1Config",
        dict(
            head_dim=8,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            lm_head_multiplier=0.25,
        ),
    ),
}
ARCHITECTURES = list(CONFIGS)


def _config(name):
    config_class, extra = CONFIGS[name]
    return getattr(transformers, config_class)(**COMMON, **extra)


def _models(name, device):
    torch.manual_seed(0)
    config = _config(name)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    model.train()
    # Random init leaves the LM head tiny; scale it so the loss is far from log(V).
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    patched = xent.hf.patch(copy.deepcopy(model))
    return model, patched


def _batch(gen, device, batch=2, length=13):
    input_ids = torch.randint(0, VOCAB, (batch, length), generator=gen).to(device)
    labels = input_ids.clone()
    labels[0, 3:6] = -100  # masked prompt tokens
    labels[1, -2:] = -100  # padding
    return input_ids, labels


def _loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    grads = {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }
    return out, grads


def _assert_same(reference, patched):
    """Both compute in fp32 and differ only in how the loss head rounds ∂logits (a few ulps of
    each); the model's own backward carries that into every parameter's gradient, where sums over
    tokens of terms of both signs (biases, norm weights, SSM decays) cancel. So the difference is
    a fraction of each gradient's norm, while an element of a cancelled sum may differ relatively
    by any amount: element-wise 1e-5 failed for 1 Python-suite seed in ~200. In norm it measured
    at most 6.5e-5 (Qwen3-Next's A_log) over 300 batches of every architecture; a wrong loss
    (one token mis-weighted in ~20) moves gradients by percents."""
    (out_ref, grads_ref), (out_xent, grads_xent) = reference, patched
    torch.testing.assert_close(out_xent.loss, out_ref.loss, rtol=1e-5, atol=1e-5)
    assert grads_ref.keys() == grads_xent.keys()
    for name, expected in grads_ref.items():
        error = (grads_xent[name] - expected).norm().item()
        bound = 5e-4 * expected.norm().item() + 1e-9
        assert error <= bound, f"{name}: error in norm {error:.3g} > {bound:.3g}"


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_patched_loss_and_gradients_equal_the_model_own(device, gen, name):
    model, patched = _models(name, device)
    input_ids, labels = _batch(gen, device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -2:] = 0
    reference = _loss_and_grads(
        model, input_ids=input_ids, attention_mask=attention_mask, labels=labels
    )
    fused = _loss_and_grads(
        patched, input_ids=input_ids, attention_mask=attention_mask, labels=labels
    )
    assert fused[0].logits is None and reference[0].logits is not None
    _assert_same(reference, fused)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_num_items_in_batch_and_shift_labels(device, gen, name):
    model, patched = _models(name, device)
    input_ids, labels = _batch(gen, device)
    items = torch.tensor(37, device=device)  # gradient accumulation over a larger batch
    _assert_same(
        _loss_and_grads(model, input_ids=input_ids, labels=labels, num_items_in_batch=items),
        _loss_and_grads(patched, input_ids=input_ids, labels=labels, num_items_in_batch=items),
    )
    shift = torch.roll(labels, -1, dims=1)
    shift[:, -1] = -100
    _assert_same(
        _loss_and_grads(model, input_ids=input_ids, labels=labels, shift_labels=shift),
        _loss_and_grads(patched, input_ids=input_ids, labels=labels, shift_labels=shift),
    )


def test_logits_still_returned_without_labels_or_in_eval(device, gen):
    model, patched = _models("llama", device)
    input_ids, labels = _batch(gen, device)
    with torch.no_grad():
        expected = model(input_ids).logits
        out = patched(input_ids)  # positional input_ids, no labels: original path
        torch.testing.assert_close(out.logits, expected)
        patched.eval()
        model.eval()
        out = patched(input_ids=input_ids, labels=labels)
        torch.testing.assert_close(out.logits, model(input_ids=input_ids, labels=labels).logits)
        torch.testing.assert_close(out.loss, model(input_ids=input_ids, labels=labels).loss)


def test_return_dict_false_and_unpatch(device, gen):
    model, patched = _models("qwen2", device)
    input_ids, labels = _batch(gen, device)
    loss = patched(input_ids=input_ids, labels=labels, return_dict=False)[0]
    torch.testing.assert_close(loss, model(input_ids=input_ids, labels=labels).loss)
    xent.hf.unpatch(patched)
    assert patched(input_ids=input_ids, labels=labels).logits is not None


def test_unsupported_model_is_refused():
    with pytest.raises(ValueError, match="model unsupported") as info:
        xent.hf.patch(torch.nn.Linear(3, 4))
    for architecture in xent.hf.SUPPORTED_ARCHITECTURES:
        assert architecture in str(info.value)


def test_every_supported_architecture_is_tested():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tested = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[_config(name).model_type] for name in CONFIGS}
    assert tested == set(xent.hf.SUPPORTED_ARCHITECTURES)


def test_patched_under_bf16_autocast_matches(gen):
    model, patched = _models("llama", "cpu")
    input_ids, labels = _batch(gen, "cpu")
    results = []
    for m in (model, patched):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_loss_and_grads(m, input_ids=input_ids, labels=labels))
    # Both round the logits to bf16 and do the softmax in fp32; only summation order differs,
    # so a logit may round to the other bf16 neighbour, and the model's own bf16 backward carries
    # that into every gradient: element-wise the two differ by independent draws of about one bf16
    # ulp (0.4 %), which failed a 2e-3 element-wise bound for 2 of 31 seeds. Per parameter in norm
    # they differ by 1.6e-3 (median) to 4.1e-3 (worst) over 42 seeds; the bound is 1e-2.
    (out_ref, grads_ref), (out_xent, grads_xent) = results
    torch.testing.assert_close(out_xent.loss, out_ref.loss, rtol=2e-3, atol=2e-3)
    assert grads_ref.keys() == grads_xent.keys()
    for name, reference in grads_ref.items():
        error = (grads_xent[name] - reference).norm() / reference.norm()
        assert error <= 1e-2, f"{name}: relative error in norm {error.item():.3g} > 1e-2"
