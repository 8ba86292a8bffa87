"""DTensor inputs (xent/_dtensor.py) against the single-process result: on the CPU with gloo, and
on GPUs with NCCL (one GPU a rank; marked gpu, run where there are as many GPUs as ranks).

World sizes 2 and 3 on a 1-D mesh from init_device_mesh("cpu", ...), vocabularies that DTensor
splits unevenly (1031: 516/515 and 344/344/343; 7: 4/3 and 3/3/1; 4 over 3 ranks, 2/2/0, which
leaves a rank nothing, is refused on every rank). Every op with Shard(-1) logits (distill also with
a whole top-k teacher) or a Shard(0) LM head (Replicate hidden): loss, statistics and the gradients
with their placements; the errors for other placements and for an FSDP2-sharded head used outside
its module's forward; no value read back to the host and no collective beyond the process-group
path's; a fully_shard-ed tiny Llama patched by xent.hf.patch trains with the same loss and gradients
as without xent. World 4: a 2 x 2 (dp, tp) mesh, FSDP2 x TP on one tiny Llama, xent's loss and
gradients against torch's loss_parallel cross-entropy. Each world size is one spawn running all its
cases.
"""

import pytest
import torch
import torch.distributed as dist
from gloo_group import run_group

ROWS, HIDDEN = 13, 24
VOCABS = (1031, 7)
_DEVICE = "cpu"  # the worker's device type: "cpu" (gloo) or "cuda" (NCCL)


def _on(value):
    """A tensor drawn on the CPU (the generators are CPU ones), moved to the worker's device."""
    return value.to(_DEVICE)


def _close(what, got, expected, rtol=2e-5, atol=2e-6):
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _full(value):
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _is_shard(placements, dim, ndim):
    from torch.distributed.tensor import Shard

    return (
        len(placements) == 1
        and isinstance(placements[0], Shard)
        and placements[0].dim % ndim == dim % ndim
    )


def _is_replicate(value):
    from torch.distributed.tensor import DTensor, Replicate

    return isinstance(value, DTensor) and all(isinstance(p, Replicate) for p in value.placements)


def _data(vocab, gen):
    logits = torch.randn(ROWS, vocab, generator=gen) * 2
    target = torch.randint(0, vocab, (ROWS,), generator=gen)
    target[::4] = -100
    return _on(logits), _on(target)


def _ce_cases(mesh, gen):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import xent

    for vocab in VOCABS:
        logits, target = _data(vocab, gen)
        class_weight = _on(torch.rand(vocab, generator=gen) + 0.5)
        row_weight = _on(torch.rand(ROWS, generator=gen))
        option_sets = [
            {},
            dict(label_smoothing=0.1, z_loss=1e-3, softcap=3.0, logit_scale=0.7),
            dict(class_weight=class_weight, row_weight=row_weight),
        ]
        for options in option_sets:
            for reduction in ("mean", "sum", "none"):
                tag = f"ce V={vocab} {sorted(options)} {reduction}"
                ref_in = logits.clone().requires_grad_()
                ref = xent.cross_entropy(
                    ref_in, target, reduction=reduction, return_stats=True, **options
                )
                upstream = _on(torch.rand(ref.loss.shape, generator=gen))
                (ref_grad,) = torch.autograd.grad(ref.loss, ref_in, upstream)
                for placement in (Shard(-1), Replicate()):
                    d = distribute_tensor(logits, mesh, [placement]).requires_grad_()
                    kwargs = dict(options)
                    if "class_weight" in kwargs and placement == Shard(-1):
                        # the sharded form of the class weights, as the logits
                        kwargs["class_weight"] = distribute_tensor(class_weight, mesh, [Shard(0)])
                    got = xent.cross_entropy(
                        d, target, reduction=reduction, return_stats=True, **kwargs
                    )
                    assert _is_replicate(got.loss), f"{tag}: loss {got.loss.placements}"
                    _close(f"{tag} loss", _full(got.loss), ref.loss)
                    for name in ("lse", "logprob", "entropy", "accuracy", "z_loss"):
                        _close(f"{tag} {name}", _full(getattr(got, name)), getattr(ref, name))
                    assert torch.equal(_full(got.argmax), ref.argmax), f"{tag} argmax"
                    up = torch.distributed.tensor.DTensor.from_local(upstream, mesh, [Replicate()])
                    (grad,) = torch.autograd.grad(got.loss, d, up)
                    if placement == Shard(-1):
                        assert _is_shard(grad.placements, -1, 2), f"{tag}: {grad.placements}"
                    _close(f"{tag} grad", _full(grad), ref_grad)
    # (B, T, V) logits sharded on dim 2, the shape a model's LM head hands over
    logits, target = _data(1031, gen)
    ref_in = logits.view(1, ROWS, -1).clone().requires_grad_()
    ref = xent.cross_entropy(ref_in, target.view(1, -1))
    (ref_grad,) = torch.autograd.grad(ref, ref_in)
    d = distribute_tensor(logits.view(1, ROWS, -1), mesh, [Shard(2)]).requires_grad_()
    got = xent.cross_entropy(d, target.view(1, -1))
    (grad,) = torch.autograd.grad(got, d)
    _close("ce 3-D loss", _full(got), ref)
    assert _is_shard(grad.placements, -1, 3)
    _close("ce 3-D grad", _full(grad), ref_grad)


def _distill_cases(mesh, gen):
    from torch.distributed.tensor import Shard, distribute_tensor

    import xent

    for vocab in VOCABS:
        student, target = _data(vocab, gen)
        teacher = _on(torch.randn(ROWS, vocab, generator=gen))
        for kind in ("forward_kl", "reverse_kl", "jsd", "soft_ce", "tvd"):
            for options in ({}, dict(temperature=2.0, hard_weight=0.5, label_smoothing=0.1)):
                tag = f"distill V={vocab} {kind} {sorted(options)}"
                ref_in = student.clone().requires_grad_()
                ref = xent.distill(ref_in, teacher, target, kind=kind, **options)
                (ref_grad,) = torch.autograd.grad(ref, ref_in)
                s = distribute_tensor(student, mesh, [Shard(-1)]).requires_grad_()
                t = distribute_tensor(teacher, mesh, [Shard(-1)])
                got = xent.distill(s, t, target, kind=kind, **options)
                assert _is_replicate(got), tag
                (grad,) = torch.autograd.grad(got, s)
                assert _is_shard(grad.placements, -1, 2), tag
                _close(f"{tag} loss", _full(got), ref)
                _close(f"{tag} grad", _full(grad), ref_grad)
        # A top-k teacher: the whole teacher (plain tensors) beside Shard(-1) student logits.
        logprobs, ids = torch.log_softmax(teacher, -1).topk(min(vocab, 5), -1)
        for mass, options in (("renormalize", dict(temperature=2.0)), ("tail", {})):
            tag = f"distill top-k V={vocab} {mass}"
            topk = xent.TopK(ids, logprobs, mass)
            options.update(kind="jsd", hard_weight=0.5)
            ref_in = student.clone().requires_grad_()
            ref = xent.distill(ref_in, target=target, teacher=topk, **options)
            (ref_grad,) = torch.autograd.grad(ref, ref_in)
            s = distribute_tensor(student, mesh, [Shard(-1)]).requires_grad_()
            got = xent.distill(s, target=target, teacher=topk, **options)
            assert _is_replicate(got), tag
            (grad,) = torch.autograd.grad(got, s)
            assert _is_shard(grad.placements, -1, 2), tag
            _close(f"{tag} loss", _full(got), ref)
            _close(f"{tag} grad", _full(grad), ref_grad)


def _logprobs_cases(mesh, gen):
    from torch.distributed.tensor import Shard, distribute_tensor

    import xent

    for vocab in VOCABS:
        logits, target = _data(vocab, gen)
        for options in ({}, dict(temperature=0.7, softcap=5.0)):
            tag = f"logprobs V={vocab} {sorted(options)}"
            ref_in = logits.clone().requires_grad_()
            ref = xent.logprobs(ref_in, target, **options)
            upstream = _on(torch.rand(ROWS, generator=gen))
            (ref_grad,) = torch.autograd.grad(ref, ref_in, upstream)
            d = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
            got = xent.logprobs(d, target, **options)
            up = torch.distributed.tensor.DTensor.from_local(upstream, mesh, got.placements)
            (grad,) = torch.autograd.grad(got, d, up)
            _close(f"{tag} logprob", _full(got), ref)
            _close(f"{tag} grad", _full(grad), ref_grad)
            with torch.no_grad():
                lp, ent = xent.logprobs(d, target, return_entropy=True, **options)
                ref_lp, ref_ent = xent.logprobs(logits, target, return_entropy=True, **options)
            _close(f"{tag} entropy", _full(ent), ref_ent)
            _close(f"{tag} logprob (with entropy)", _full(lp), ref_lp)
        try:
            xent.logprobs(d, target, return_entropy=True)
        except ValueError as error:
            assert "return_entropy" in str(error)
        else:
            raise AssertionError("return_entropy with a gradient on Shard(-1) accepted")


def _linear_inputs(vocab, gen):
    hidden = torch.randn(ROWS, HIDDEN, generator=gen)
    weight = torch.randn(vocab, HIDDEN, generator=gen) / HIDDEN**0.5
    bias = torch.randn(vocab, generator=gen) * 0.1
    target = torch.randint(0, vocab, (ROWS,), generator=gen)
    target[::4] = -100
    return _on(hidden), _on(weight), _on(bias), _on(target)


def _linear_cases(mesh, gen):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import xent

    for vocab in VOCABS:
        hidden, weight, bias, target = _linear_inputs(vocab, gen)
        for options in (
            {},
            dict(z_loss=1e-3, softcap=4.0, grad_in_forward=False),
            dict(reduction="sum", workspace_bytes=max(4096, 24 * vocab)),
        ):
            for reduce_hidden_grad in (True, False):
                tag = f"linear_ce V={vocab} {sorted(options)} reduce={reduce_hidden_grad}"
                ref_in = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
                ref = xent.linear_cross_entropy(ref_in[0], ref_in[1], target, ref_in[2], **options)
                ref_grads = torch.autograd.grad(ref, ref_in)
                h = distribute_tensor(hidden, mesh, [Replicate()]).requires_grad_()
                w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
                b = distribute_tensor(bias, mesh, [Shard(0)]).requires_grad_()
                got = xent.linear_cross_entropy(
                    h, w, target, b, reduce_hidden_grad=reduce_hidden_grad, **options
                )
                assert _is_replicate(got), tag
                _close(f"{tag} loss", _full(got), ref, rtol=1e-4, atol=1e-5)
                grads = torch.autograd.grad(got, (h, w, b))
                hidden_kind = Replicate if reduce_hidden_grad else Partial
                assert isinstance(grads[0].placements[0], hidden_kind), grads[0].placements
                assert _is_shard(grads[1].placements, 0, 2) and _is_shard(
                    grads[2].placements, 0, 1
                ), tag
                for name, a, e in zip(("hidden", "weight", "bias"), grads, ref_grads):
                    _close(f"{tag} ∂{name}", _full(a), e, rtol=1e-4, atol=1e-5)
        # linear_logprobs and linear_distill: local logits per rank, then the sharded op
        h = distribute_tensor(hidden, mesh, [Replicate()]).requires_grad_()
        w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
        ref_in = [t.clone().requires_grad_() for t in (hidden, weight)]
        ref = xent.linear_logprobs(ref_in[0], ref_in[1], target, temperature=0.8)
        upstream = _on(torch.rand(ROWS, generator=gen))
        ref_grads = torch.autograd.grad(ref, ref_in, upstream)
        got = xent.linear_logprobs(h, w, target, temperature=0.8)
        grads = torch.autograd.grad(got, (h, w), DTensor.from_local(upstream, mesh, got.placements))
        _close(f"linear_logprobs V={vocab}", _full(got), ref, rtol=1e-4, atol=1e-5)
        for a, e in zip(grads, ref_grads):
            _close(f"linear_logprobs V={vocab} grad", _full(a), e, rtol=1e-4, atol=1e-5)
        teacher_hidden = _on(torch.randn(ROWS, 8, generator=gen))
        teacher_weight = _on(torch.randn(vocab, 8, generator=gen))
        for kind in ("forward_kl", "jsd"):
            ref = xent.linear_distill(
                ref_in[0],
                ref_in[1],
                None,
                target,
                kind=kind,
                teacher_hidden=teacher_hidden,
                teacher_weight=teacher_weight,
                hard_weight=0.3,
            )
            ref_grads = torch.autograd.grad(ref, ref_in)
            got = xent.linear_distill(
                h,
                w,
                None,
                target,
                kind=kind,
                hard_weight=0.3,
                teacher_hidden=distribute_tensor(teacher_hidden, mesh, [Replicate()]),
                teacher_weight=distribute_tensor(teacher_weight, mesh, [Shard(0)]),
            )
            assert _is_replicate(got)
            grads = torch.autograd.grad(got, (h, w))
            _close(f"linear_distill V={vocab} {kind}", _full(got), ref, rtol=1e-4, atol=1e-5)
            for a, e in zip(grads, ref_grads):
                _close(f"linear_distill V={vocab} {kind} grad", _full(a), e, rtol=1e-4, atol=1e-5)


def _error_cases(mesh, gen):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import xent

    logits, target = _data(1031, gen)

    def refused(call, *words):
        try:
            call()
        except ValueError as error:
            for word in words:
                assert word in str(error), f"{word!r} not in {error}"
        else:
            raise AssertionError(f"accepted: {words}")

    if mesh.size() == 3:
        empty = distribute_tensor(logits[:, :4], mesh, [Shard(-1)])
        refused(lambda: xent.cross_entropy(empty, target), "no columns")
    rows = distribute_tensor(logits, mesh, [Shard(0)])
    refused(lambda: xent.cross_entropy(rows, target), "Shard(dim=0)", "accepted: Shard(-1)")
    partial = DTensor.from_local(logits, mesh, [Partial()])
    refused(lambda: xent.cross_entropy(partial, target), "Partial", "accepted")
    sharded = distribute_tensor(logits, mesh, [Shard(-1)])
    try:
        xent.cross_entropy(sharded, target, process_group=dist.group.WORLD)
    except TypeError as error:
        assert "process_group" in str(error) and "DTensor" in str(error), error
    else:
        raise AssertionError("DTensor with process_group accepted")
    refused(
        lambda: xent.cross_entropy(sharded, distribute_tensor(target, mesh, [Shard(0)])),
        "target",
        "Replicate",
    )
    hidden, weight, _, target = _linear_inputs(1031, gen)
    # an FSDP2-style weight (rows sharded) beside a plain hidden: refused with the remedy
    w = distribute_tensor(weight, mesh, [Shard(0)])
    refused(
        lambda: xent.linear_cross_entropy(hidden, w, target),
        "FSDP2",
        "fully_shard",
        "inside the forward",
    )
    h = distribute_tensor(hidden, mesh, [Shard(0)])
    refused(lambda: xent.linear_cross_entropy(h, w, target), "hidden", "Replicate")
    refused(
        lambda: xent.linear_cross_entropy(
            distribute_tensor(hidden, mesh, [Replicate()]), weight, target
        ),
        "weight",
        "plain",
    )


def _quiet_cases(mesh, gen):
    """A DTensor training call issues the collectives of the process-group path and no others,
    and reads no tensor value back to the host (on a GPU, a synchronisation with the device)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.profiler import ProfilerActivity, profile

    import xent

    logits, target = _data(1031, gen)
    hidden, weight, _, _ = _linear_inputs(1031, gen)
    d = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
    teacher = distribute_tensor(_on(torch.randn(logits.shape, generator=gen)), mesh, [Shard(-1)])
    h = distribute_tensor(hidden, mesh, [Replicate()]).requires_grad_()
    w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    calls = {  # loss, inputs, the process-group path's collectives
        "cross_entropy": (lambda: xent.cross_entropy(d, target), (d,), 1),
        "linear_cross_entropy": (lambda: xent.linear_cross_entropy(h, w, target), (h, w), 2),
        "distill": (lambda: xent.distill(d, teacher, target), (d,), 1),
        "logprobs": (lambda: xent.logprobs(d, target).sum(), (d,), 1),
    }
    for name, (loss, inputs, collectives) in calls.items():
        torch.autograd.grad(loss(), inputs)  # first calls may look things up once
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(loss(), inputs)
        names = [event.name for event in prof.events()]
        assert "aten::item" not in names, f"{name}: a value read back on the host"
        got = sum(event.startswith("c10d::") for event in names)
        assert got == collectives, (
            f"{name}: {got} collectives, the process-group path {collectives}"
        )


def _tiny_llama(vocab, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().to(_DEVICE)


def _fsdp_cases(mesh, rank):
    """fully_shard (FSDP2) on a patched tiny Llama: the same loss and gradients as without xent;
    an LM head wrapped on its own (sharded outside its forward) is refused with the remedy."""
    from torch.distributed.fsdp import fully_shard

    import xent.hf

    vocab = 101
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    ids = _on(torch.randint(0, vocab, (2, 9), generator=gen))
    models = []
    for patched in (False, True):
        model = _tiny_llama(vocab, 0).train()
        if patched:
            xent.hf.patch(model, skip_logits=True)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        models.append(
            (loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()})
        )
    (ref_loss, ref_grads), (loss, grads) = models
    _close("fsdp loss", loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        _close(f"fsdp ∂{name}", grad, ref_grads[name], rtol=1e-4, atol=1e-6)
    model = xent.hf.patch(_tiny_llama(vocab, 0).train(), skip_logits=True)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        model(input_ids=ids, labels=ids)
    except ValueError as error:
        assert "fully_shard" in str(error) and "FSDP2" in str(error), error
    else:
        raise AssertionError("an LM head sharded outside its forward was accepted")


def _fsdp_tp_cases(rank):
    """2 x 2 mesh (dp, tp): FSDP2 over dp, the LM head column-parallel over tp with Shard(-1)
    logits; xent's loss and gradients against torch's loss_parallel cross-entropy."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    import xent

    mesh = init_device_mesh(_DEVICE, (2, 2), mesh_dim_names=("dp", "tp"))
    vocab = 101  # uneven over tp: 51 / 50
    dp_rank = mesh.get_local_rank("dp")
    gen = torch.Generator().manual_seed(200 + dp_rank)  # the tp ranks of a dp rank share data
    ids = torch.randint(0, vocab, (2, 9), generator=gen)
    labels = _on(torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1))
    ids = _on(ids)
    results = []
    for use_xent in (False, True):
        model = _tiny_llama(vocab, 0).train()
        parallelize_module(
            model.lm_head,
            mesh["tp"],
            ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        logits = model(input_ids=ids).logits
        assert _is_shard(logits.placements, -1, 3), logits.placements
        if use_xent:
            loss = xent.cross_entropy(logits, labels)
        else:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if use_xent:
            loss.backward()
        else:
            with loss_parallel():
                loss.backward()
        results.append(
            (
                loss.full_tensor().detach(),
                {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            )
        )
    (ref_loss, ref_grads), (loss, grads) = results
    _close("fsdp x tp loss", loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        _close(f"fsdp x tp ∂{name}", grad, ref_grads[name], rtol=1e-4, atol=1e-6)


def _body(rank, world, group, device):
    global _DEVICE
    _DEVICE = device
    if world == 4:
        _fsdp_tp_cases(rank)
        return
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (world,))
    gen = torch.Generator().manual_seed(1234)  # the same full tensors on every rank
    for cases in (
        _ce_cases,
        _distill_cases,
        _logprobs_cases,
        _linear_cases,
        _error_cases,
        _quiet_cases,
    ):
        cases(mesh, gen)
    _fsdp_cases(mesh, rank)


def _cases():
    for world in (2, 3, 4):
        yield pytest.param(world, "cpu", id=f"{world}-cpu")
        gpu = [
            pytest.mark.gpu,
            pytest.mark.skipif(
                torch.cuda.device_count() < world, reason=f"fewer than {world} GPUs"
            ),
        ]
        yield pytest.param(world, "cuda", id=f"{world}-cuda", marks=gpu)


@pytest.mark.parametrize("world, device", _cases())
def test_dtensor_matches_single_process(world, device):
    pytest.importorskip("torch.distributed.tensor")
    if world == 4:
        pytest.importorskip("transformers")
    run_group(world, _body, (device,), nccl=device == "cuda")
