"""xent.hf.patch on tiny random-init Hugging Face causal LMs built from configs (no download):
loss and every parameter gradient equal to the unpatched model's."""

import copy

import pytest
import torch

import xent

transformers = pytest.importorskip("transformers")

VOCAB = 211  # odd on purpose
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _config(name):
    if name == "llama":
        return transformers.LlamaConfig(**COMMON)
    if name == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=None)
    if name == "qwen2":
        return transformers.Qwen2Config(**COMMON)
    if name == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=8)
    if name == "gemma2":
        # A small cap so the softcap changes the loss noticeably even at random init.
        return transformers.Gemma2Config(**COMMON, head_dim=8, final_logit_softcapping=0.5,
                                         query_pre_attn_scalar=8)
    if name == "gemma3":
        return transformers.Gemma3TextConfig(**COMMON, head_dim=8, final_logit_softcapping=0.7,
                                             query_pre_attn_scalar=8)
    if name == "phi3":
        return transformers.Phi3Config(**COMMON, pad_token_id=0)
    raise ValueError(name)


ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]


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
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return out, grads


def _assert_same(reference, patched, tol=1e-5):
    (out_ref, grads_ref), (out_xent, grads_xent) = reference, patched
    torch.testing.assert_close(out_xent.loss, out_ref.loss, rtol=tol, atol=tol)
    assert grads_ref.keys() == grads_xent.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads_xent[name], grads_ref[name], rtol=tol, atol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_patched_loss_and_gradients_equal_the_model_own(device, gen, name):
    model, patched = _models(name, device)
    input_ids, labels = _batch(gen, device)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -2:] = 0
    reference = _loss_and_grads(model, input_ids=input_ids, attention_mask=attention_mask,
                                labels=labels)
    fused = _loss_and_grads(patched, input_ids=input_ids, attention_mask=attention_mask,
                            labels=labels)
    assert fused[0].logits is None and reference[0].logits is not None
    _assert_same(reference, fused)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_num_items_in_batch_and_shift_labels(device, gen, name):
    model, patched = _models(name, device)
    input_ids, labels = _batch(gen, device)
    items = torch.tensor(37, device=device)  # gradient accumulation over a larger batch
    _assert_same(_loss_and_grads(model, input_ids=input_ids, labels=labels,
                                 num_items_in_batch=items),
                 _loss_and_grads(patched, input_ids=input_ids, labels=labels,
                                 num_items_in_batch=items))
    shift = torch.roll(labels, -1, dims=1)
    shift[:, -1] = -100
    _assert_same(_loss_and_grads(model, input_ids=input_ids, labels=labels, shift_labels=shift),
                 _loss_and_grads(patched, input_ids=input_ids, labels=labels,
                                 shift_labels=shift))


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
    with pytest.raises(ValueError, match="model unsupported"):
        xent.hf.patch(torch.nn.Linear(3, 4))


def test_patched_under_bf16_autocast_matches(gen):
    model, patched = _models("llama", "cpu")
    input_ids, labels = _batch(gen, "cpu")
    results = []
    for m in (model, patched):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_loss_and_grads(m, input_ids=input_ids, labels=labels))
    # Both round the logits to bf16 and do the softmax in fp32; only summation order differs.
    _assert_same(results[0], results[1], tol=2e-3)
