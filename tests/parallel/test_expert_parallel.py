"""Expert parallelism in the mixture-of-experts mixer, on spawned gloo ranks in float64: a rank's experts are
drawn as one device draws them, and a layer whose experts are split over the ranks gives each rank the output and
input gradient the whole layer gives its tokens; the router's and the shared expert's gradients are its own
tokens', and an expert's gradient is the sum over every rank's tokens (what the expert-data-parallel reduction
then averages). Cases: softmax routing; sigmoid routing with a bias that sends every token to the first rank's
experts (the other rank receives no rows); a capacity dropping rows before they travel. The expert-parallel and
expert-data-parallel groups are consecutive and strided ranks of the data axis."""

import pytest
import torch

from distributed import group_members, run_ranks
from megamamba.config import MoEOptions

pytestmark = pytest.mark.slow

D_MODEL, EXPERTS, TOKENS = 6, 8, (2, 7)
TOLERANCE = 1e-9
CASES = {
    "softmax": dict(score_function="softmax", activation="gated_silu"),
    "all_to_the_first_rank": dict(score_function="sigmoid", expert_bias=True, activation="relu2", top_k=3),
    "capacity": dict(score_function="softmax", capacity_factor=0.75),
}


def _options(case: str) -> MoEOptions:
    fields = dict(num_experts=EXPERTS, top_k=2, ffn_hidden_size=5, shared_expert_ffn_hidden_size=3)
    return MoEOptions(**{**fields, **CASES[case]})


def _layer(case: str, ep=None):
    from megamamba.model.moe import MoE

    torch.manual_seed(11)
    moe = MoE(D_MODEL, _options(case), dtype=torch.float64, ep=ep)
    if moe.gate.e_score_correction_bias is not None:
        with torch.no_grad():
            moe.gate.e_score_correction_bias.copy_(torch.tensor([5.0] * (EXPERTS // 2) + [0.0] * (EXPERTS // 2)))
    return moe


def _hidden(rank: int) -> torch.Tensor:
    return torch.randn(*TOKENS, D_MODEL, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def _run(moe, hidden: torch.Tensor, seed: int) -> dict:
    hidden = hidden.clone().requires_grad_(True)
    out = moe(hidden)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    named = [(n, p) for n, p in moe.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * cotangent).sum(), [hidden, *(p for _, p in named)])
    return {"out": out.detach(), "hidden": grads[0], **{n: g for (n, _), g in zip(named, grads[1:])}}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any()
    return ((got - want).norm() / want.norm().clamp(min=1e-300)).item()


def split_layer_errors(case: str, ep_size: int):
    import torch.distributed as dist

    from megamamba.parallel.groups import ParallelGroups

    groups = ParallelGroups(expert_parallel_size=ep_size)
    ep = groups.expert_parallel()
    rank, world = dist.get_rank(), dist.get_world_size()
    whole, split = _layer(case), _layer(case, ep)
    here = ep.experts_here(EXPERTS)
    drawn = max(
        _relative(getattr(split.experts, n)[:], getattr(whole.experts, n)[here.start : here.stop])
        for n in ("up_proj", "down_proj")
    )
    received = []
    split.experts.register_forward_hook(lambda module, args, out: received.append(args[0].shape[0]))
    mine = _run(split, _hidden(rank), seed=rank)
    wants = [_run(whole, _hidden(r), seed=r) for r in range(world)]
    errors = {}
    for name, got in mine.items():
        if name.startswith("experts."):
            members = group_members(ep.group)
            want = sum(wants[r][name] for r in members)[here.start : here.stop]
        else:
            want = wants[rank][name]
        errors[name] = _relative(got, want)
    return dict(
        drawn=drawn,
        errors=errors,
        received=received[0],
        ep=(ep.rank, group_members(ep.group)),
        edp=(groups.expert_data_rank, group_members(groups.expert_data_group)),
    )


@pytest.mark.parametrize("case", list(CASES))
def test_a_layer_split_over_two_expert_ranks_gives_each_rank_the_whole_layers_outputs_and_gradients(case):
    for rank, result in enumerate(run_ranks(split_layer_errors, 2, args=(case, 2))):
        assert result["drawn"] == 0.0, (case, rank)
        bad = {name: error for name, error in result["errors"].items() if not error <= TOLERANCE}
        assert not bad, f"case {case}, rank {rank}, seeds 11 / {100 + rank}: {bad}"
        if case == "all_to_the_first_rank":
            assert result["received"] == (2 * 3 * TOKENS[0] * TOKENS[1] if rank == 0 else 0), result["received"]


def test_expert_groups_are_consecutive_and_expert_data_groups_strided_ranks_of_the_data_axis():
    results = run_ranks(split_layer_errors, 4, args=("softmax", 2))
    assert [r["ep"] for r in results] == [(0, [0, 1]), (1, [0, 1]), (0, [2, 3]), (1, [2, 3])]
    assert [r["edp"] for r in results] == [(0, [0, 2]), (0, [1, 3]), (1, [0, 2]), (1, [1, 3])]
    assert all(max(r["errors"].values()) <= TOLERANCE for r in results), [r["errors"] for r in results]
