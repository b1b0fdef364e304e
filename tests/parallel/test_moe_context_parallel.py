"""A mixture-of-experts router under context parallelism, on 2 spawned gloo ranks in float64: each rank's
losses are its slice's share of the whole sequences' losses (the load-balancing loss over the micro-batch or per
sequence, and the z-loss): the shares add up to the one-device loss, and so do their gradients of the router's
weight, while each rank's input gradient is its slice of the one-device one."""

import pytest
import torch

from distributed import run_ranks
from megamamba.config import MoEOptions

pytestmark = pytest.mark.slow

D_MODEL, BATCH, SEQLEN = 6, 2, 10
CASES = {
    "aux_loss": dict(aux_loss_coeff=0.1, aux_loss_type="aux_loss"),
    "seq_aux_loss_sigmoid": dict(aux_loss_coeff=0.1, aux_loss_type="seq_aux_loss", score_function="sigmoid"),
    "z_loss": dict(z_loss_coeff=0.01),
}


def _losses_and_gradients(router, hidden: torch.Tensor) -> tuple:
    hidden = hidden.clone().requires_grad_(True)
    loss = router(hidden).aux_loss
    weight_grad, hidden_grad = torch.autograd.grad(loss, [router.weight, hidden])
    return loss.detach(), weight_grad, hidden_grad


def shares(case: str):
    import torch.distributed as dist

    from megamamba.model.moe_router import Router
    from megamamba.parallel.context.context_parallel import sequence_slice
    from megamamba.parallel.groups import ParallelGroups

    options = MoEOptions(num_experts=8, top_k=2, ffn_hidden_size=4, **CASES[case])
    torch.manual_seed(5)
    whole = Router(D_MODEL, options, dtype=torch.float64)
    cp = ParallelGroups(context_parallel_size=2).context_parallel()
    split = Router(D_MODEL, options, dtype=torch.float64, cp=cp)
    split.load_state_dict(whole.state_dict())
    hidden = torch.randn(BATCH, SEQLEN, D_MODEL, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    loss, weight_grad, hidden_grad = _losses_and_gradients(whole, hidden)
    share, share_weight_grad, share_hidden_grad = _losses_and_gradients(split, sequence_slice(hidden, cp))
    summed = torch.stack([share, *share_weight_grad.flatten()])
    dist.all_reduce(summed)
    relative = lambda got, want: ((got - want).norm() / want.norm()).item()  # noqa: E731
    return dict(
        loss=relative(summed[:1], loss.reshape(1)),
        weight_grad=relative(summed[1:], weight_grad.flatten()),
        hidden_grad=relative(share_hidden_grad, sequence_slice(hidden_grad, cp)),
    )


@pytest.mark.parametrize("case", list(CASES))
def test_each_context_rank_computes_its_share_of_the_whole_sequences_router_losses(case):
    for rank, errors in enumerate(run_ranks(shares, 2, args=(case,))):
        assert all(error <= 1e-12 for error in errors.values()), (case, rank, "seeds 5 / 6", errors)
