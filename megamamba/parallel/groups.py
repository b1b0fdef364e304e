"""Data x context x tensor x pipeline process groups, and the expert groups carved from the data axis: the one
module that owns them.

Laid out by DeepSpeed's `PipeModelDataParallelTopology`, which the pipeline engine builds its
grid from too, so our layers and the engine agree on every rank's coordinates. The context axis
lives inside DeepSpeed's data axis: docs/context-parallel.md; group creation: docs/code.md. An expert-parallel
group is E consecutive ranks of the data axis, its expert-data-parallel group every E-th rank of it.
"""

from __future__ import annotations

import logging
import os
import threading

import deepspeed
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megamamba.errors import MegamambaError
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.expert.expert_parallel import ExpertParallel
from megamamba.parallel.tensor.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)
SLOW_START_S = 10.0  # after this long in init_distributed, rank 0 of each node says what it waits for


class RendezvousError(MegamambaError, RuntimeError):
    """The ranks cannot meet: the launcher's master port is taken."""


def init_distributed(**kwargs) -> None:
    """`deepspeed.init_distributed(**kwargs)`, then release DeepSpeed's CPU shared-memory buffer name;
    RendezvousError when rank 0 cannot listen on the master port because another process holds it.

    On CPU, DeepSpeed 0.19 gives every rank a ~66 MB all-reduce buffer in /dev/shm (RAM) and
    never unlinks it, so each run would leave world_size of them behind until the machine runs
    out of memory. Once every rank has mapped every buffer (DeepSpeed's initialisation waits for
    that; the barrier makes sure all ranks are past it) the names can go: the mappings stay valid.

    A start that takes longer than SLOW_START_S is said on each node's first rank: on the CPU, DeepSpeed
    builds its communication op on a machine's first run (about 2 minutes), silently.
    """
    notice = threading.Timer(SLOW_START_S, log.info, [_slow_start_notice()])
    notice.daemon = True
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        notice.start()
    try:
        deepspeed.init_distributed(**kwargs)
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        port = int(os.environ.get("MASTER_PORT", "29500"))
        raise RendezvousError(
            f"master port {port} on {os.environ.get('MASTER_ADDR')} is in use by another process (another run?): "
            f"give the launcher a free one, e.g. deepspeed --master_port {port + 1} ..."
        ) from None
    finally:
        notice.cancel()
    dist.barrier()
    name = "/dev/shm/deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), dist.get_rank()
    )
    if os.path.exists(name):
        os.unlink(name)


def _slow_start_notice() -> str:
    waiting = f"still starting the process group after {SLOW_START_S:.0f} s"
    if get_accelerator().device_name() == "cpu":
        return f"{waiting}: DeepSpeed builds its CPU communication op on a machine's first run (about 2 minutes, once)"
    return f"{waiting}: waiting for every rank of every node to start"


def shutdown_distributed() -> None:
    """Leave together: a barrier, then destroy the default group.

    A rank that exits while peers still hold connections to it can make them abort at exit
    (seen across two simulated nodes: "terminate called without an active exception").
    """
    dist.barrier()
    dist.destroy_process_group()


def data_parallel_size_for(
    world_size: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_parallel_size: int | None = None,
    context_parallel_size: int = 1,
) -> int:
    """The data-parallel size (replicas) of a layout, refusing impossible ones with the numbers and the rule.

    Given, `data_parallel_size` must make data x context x tensor x pipeline = world size; omitted, it
    is world / (context x tensor x pipeline), which must divide evenly.
    """
    sizes = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "context_parallel_size": context_parallel_size,
    }
    if data_parallel_size is not None:
        sizes["data_parallel_size"] = data_parallel_size
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    model = context_parallel_size * tensor_parallel_size * pipeline_parallel_size
    named = f"context ({context_parallel_size}) x tensor ({tensor_parallel_size}) x pipeline ({pipeline_parallel_size})"
    if data_parallel_size is None:
        if world_size % model:
            raise ValueError(
                f"world size {world_size} is not divisible by {named} = {model}; "
                "data-parallel size = world / (context x tensor x pipeline)"
            )
        return world_size // model
    if data_parallel_size * model != world_size:
        raise ValueError(
            f"world size {world_size} != data ({data_parallel_size}) x {named} = {data_parallel_size * model}"
        )
    return data_parallel_size


def topology(
    tensor_parallel_size: int, pipeline_parallel_size: int, data_parallel_size: int, context_parallel_size: int = 1
):
    """The rank layout shared by our groups and DeepSpeed's pipeline engine (TP rank fastest; the data
    axis holds data x context ranks)."""
    return PipeModelDataParallelTopology(
        num_pp=pipeline_parallel_size, num_mp=tensor_parallel_size, num_dp=data_parallel_size * context_parallel_size
    )


class ParallelGroups:
    """This rank's data, context, tensor, pipeline and expert groups, ranks and sizes.

    Needs `torch.distributed` initialised (e.g. by `deepspeed.init_distributed()`); collective:
    every rank must construct it with the same sizes. `data_axis_rank` / `data_axis_size` are the
    rank's place on DeepSpeed's data axis (dp x cp ranks), whose group is `data_group`; `expert_group` /
    `expert_data_group` (None at expert-parallel size 1) its expert-parallel and expert-data-parallel groups.
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | None = None,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call deepspeed.init_distributed() "
                "or torch.distributed.init_process_group() before building ParallelGroups"
            )
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.context_parallel_size = context_parallel_size
        self.data_parallel_size = data_parallel_size_for(
            self.world_size, tensor_parallel_size, pipeline_parallel_size, data_parallel_size, context_parallel_size
        )
        self.data_axis_size = self.data_parallel_size * context_parallel_size
        self.topology = topology(tensor_parallel_size, pipeline_parallel_size, self.data_axis_size)
        coord = self.topology.get_coord(self.rank)
        self.tensor_rank, self.data_axis_rank, self.pipe_rank = coord.model, coord.data, coord.pipe
        self.data_rank, self.context_rank = divmod(self.data_axis_rank, context_parallel_size)
        self.tensor_group, self.tensor_ranks = self._new_groups(self.topology.get_axis_comm_lists("model"))
        self.data_group, self.data_ranks = self._new_groups(self.topology.get_axis_comm_lists("data"))
        self.pipe_group, self.pipe_ranks = self._new_groups(self.topology.get_axis_comm_lists("pipe"))
        self.context_group, self.context_ranks = None, [self.rank]  # without CP: no group to create
        if context_parallel_size > 1:
            self.context_group, self.context_ranks = self._new_groups(
                [
                    axis[i : i + context_parallel_size]
                    for axis in self.topology.get_axis_comm_lists("data")
                    for i in range(0, len(axis), context_parallel_size)
                ]
            )
        self.expert_parallel_size = expert_parallel_size
        self.expert_rank, self.expert_data_rank = self.data_axis_rank % expert_parallel_size, 0
        self.expert_group, self.expert_data_group = None, None
        if expert_parallel_size > 1:
            if self.data_axis_size % expert_parallel_size:
                raise ValueError(
                    f"expert-parallel size {expert_parallel_size} does not divide the data axis "
                    f"(data x context = {self.data_axis_size} ranks)"
                )
            axes = self.topology.get_axis_comm_lists("data")
            size = expert_parallel_size
            self.expert_group, _ = self._new_groups([a[i : i + size] for a in axes for i in range(0, len(a), size)])
            self.expert_data_group, _ = self._new_groups([a[i::size] for a in axes for i in range(size)])
            self.expert_data_rank = self.data_axis_rank // expert_parallel_size

    def _new_groups(self, rank_lists: list[list[int]]) -> tuple[dist.ProcessGroup, list[int]]:
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks=ranks)
            if self.rank in ranks:
                mine = (group, ranks)
        return mine

    def tensor_parallel(self, sequence_parallel: bool = False) -> TensorParallel:
        """What the parallel layers receive."""
        return TensorParallel(self.tensor_group, self.tensor_parallel_size, self.tensor_rank, sequence_parallel)

    def context_parallel(self) -> ContextParallel:
        """What the mixers and the loss receive: this rank's slice of every sequence."""
        return ContextParallel(self.context_group, self.context_parallel_size, self.context_rank)

    def expert_parallel(self) -> ExpertParallel:
        """What the mixture-of-experts layers receive: this rank's share of their experts."""
        return ExpertParallel(self.expert_group, self.expert_parallel_size, self.expert_rank)

    def mpu(self) -> DeepSpeedMPU:
        """The `mpu` for `deepspeed.initialize` with the plain engine (pipeline size 1)."""
        return DeepSpeedMPU(self)

    def __repr__(self) -> str:
        return (
            f"ParallelGroups(rank {self.rank}/{self.world_size}: data {self.data_rank}/{self.data_parallel_size}, "
            f"context {self.context_rank}/{self.context_parallel_size}, "
            f"tensor {self.tensor_rank}/{self.tensor_parallel_size}, "
            f"pipe {self.pipe_rank}/{self.pipeline_parallel_size})"
        )


class DeepSpeedMPU:
    """Megatron's `mpu` interface as DeepSpeed's plain engine reads it; model parallel = tensor, data
    parallel = the whole data axis (dp x cp ranks: DeepSpeed reduces gradients over it).

    Only for pipeline size 1: with a `PipelineModule`, `deepspeed.initialize` takes mpu=None
    and uses the module's own grid (built from the same topology). Deliberately no
    `get_sequence_parallel_*`: DeepSpeed would read those as Ulysses sequence parallelism.
    """

    def __init__(self, groups: ParallelGroups):
        if groups.pipeline_parallel_size != 1:
            raise ValueError(
                f"an mpu is for DeepSpeed's plain engine (pipeline size 1), got pipeline size "
                f"{groups.pipeline_parallel_size}: pass mpu=None with a PipelineModule, which brings its own grid"
            )
        self._g = groups

    def get_model_parallel_rank(self) -> int:
        return self._g.tensor_rank

    def get_model_parallel_world_size(self) -> int:
        return self._g.tensor_parallel_size

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._g.tensor_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self._g.tensor_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._g.tensor_parallel_size

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self._g.tensor_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's tensor group."""
        return self._g.tensor_ranks[0]

    def get_data_parallel_rank(self) -> int:
        return self._g.data_axis_rank

    def get_data_parallel_world_size(self) -> int:
        return self._g.data_axis_size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self._g.data_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._g.data_ranks)

    def get_pipe_parallel_rank(self) -> int:
        return self._g.pipe_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self._g.pipeline_parallel_size

    def get_pipe_parallel_group(self) -> dist.ProcessGroup:
        return self._g.pipe_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group
