"""A NaN or infinity in the weights any rank resumes from stops every rank with the same one line.

At `--load` each rank reads only the pieces of its own stage and tensor-parallel slice, so a damaged
tensor may reach only some ranks; a rank that stopped alone would leave the others blocked in their
first collective.
"""

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from megamamba.checkpoint import CheckpointError
from megamamba.checkpoint.finite import DamagedWeightsError, check_finite


def check_finite_on_every_rank(values: Mapping[str, torch.Tensor], cuts: Mapping[str, tuple], where: str) -> None:
    """CheckpointError on every rank (collective) naming the first tensor, of the first rank that read one, that
    holds NaN / inf. values: parameter -> this rank's tensor; cuts: parameter -> (stored name, its `Cut`)."""
    error = None
    try:
        for parameter, tensor in values.items():
            name, cut = cuts[parameter]
            check_finite({name: tensor}, where, {name: cut})
    except DamagedWeightsError as e:
        error = str(e)
    raise_first_rank_error(error)


def raise_first_rank_error(error: Optional[str]) -> None:
    """CheckpointError on every rank (collective: one small object gather) with the message of the first rank
    whose `error` is not None; nothing when no rank has one."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)
