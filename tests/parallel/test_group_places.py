"""A rank's place in a tensor-, context- or expert-parallel group is checked the same way: a size of at least
one, a rank inside it, and a process group when the size is above one; each refusal names the kind."""

import pytest

from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.expert.expert_parallel import ExpertParallel

KINDS = {"tensor-parallel": TensorParallel, "context-parallel": ContextParallel, "expert-parallel": ExpertParallel}
PLACES = [
    (dict(size=0), "size must be >= 1, got 0"),
    (dict(size=2, rank=2, group=object()), "rank 2 is outside [0, 2)"),
    (dict(size=2, rank=1), "size 2 > 1 needs a process group, got None"),
]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("place, rule", PLACES)
def test_an_impossible_place_in_a_group_is_refused_naming_its_kind(kind, place, rule):
    with pytest.raises(ValueError) as refused:
        KINDS[kind](**place)
    assert str(refused.value) == f"{kind} {rule}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_rank_without_a_group_is_a_place(kind):
    assert KINDS[kind]().size == 1
