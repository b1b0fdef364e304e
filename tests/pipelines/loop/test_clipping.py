"""Stage-0 gradient clipping counts every parameter of the model once."""

import torch

from megamamba.pipelines.loop.clipping import clip_, counted_here, global_grad_norm


def _param(grad, **attrs):
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def test_the_pipelines_second_copy_of_a_tied_weight_is_left_out():
    g = torch.Generator().manual_seed(3)
    a, tied_copy = torch.randn(5, 3, generator=g), torch.randn(7, generator=g)
    params = [_param(a), _param(tied_copy, ds_pipe_replicated=True)]
    assert torch.allclose(global_grad_norm(params, 0, None), a.double().norm())


def test_tensor_replicated_parameters_count_on_tensor_rank_0_only_shards_everywhere():
    shard, replica = _param(torch.ones(4), tensor_model_parallel=True), _param(torch.ones(9))
    assert counted_here(shard, 1) and counted_here(shard, 0)
    assert counted_here(replica, 0) and not counted_here(replica, 1)
    assert global_grad_norm([shard, replica], 1, None).item() == 2.0
    assert global_grad_norm([shard, replica], 0, None).item() == (4 + 9) ** 0.5


def test_clipping_scales_every_gradient_to_the_max_norm_and_returns_the_norm_before():
    params = [_param(torch.full((4,), 3.0)), _param(torch.full((4,), 4.0))]  # norm 10
    norm = clip_(params, 1.0, 0, None)
    assert norm.item() == 10.0
    assert abs(global_grad_norm(params, 0, None).item() - 1.0) < 1e-6
    small = [_param(torch.full((1,), 0.5))]
    clip_(small, 1.0, 0, None)
    assert small[0].grad.item() == 0.5
