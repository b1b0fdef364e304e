"""Parallelism inside a stage: tensor/sequence parallelism (`tensor/`), context parallelism
(`context/`), the process groups, rank placement and communication counts.

This package re-exports the tensor-parallel API. Nothing imported here touches DeepSpeed; the
process groups live in `megamamba.parallel.groups` (the one module that may import DeepSpeed's
topology classes).
"""

from megamamba.parallel.comm_counter import CommRecord, CommTotals, comm_counter
from megamamba.parallel.split import split
from megamamba.parallel.tensor.collectives import (
    copy_to_tp_region,
    gather_from_sequence_region,
    gather_from_tp_region,
    gather_whole_sequence,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_sequence_region,
    scatter_to_tp_region,
    start_sequence_gather,
)
from megamamba.parallel.tensor.components import component_parameters, in_component_order
from megamamba.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from megamamba.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from megamamba.parallel.tensor.linear import parallel_linear
from megamamba.parallel.tensor.sharding import (
    Component,
    Shard,
    assemble_full,
    full_key,
    full_tensors,
    gather_full,
    load_full_tensors,
    local_shard,
    mark,
    tp_padded_vocab_size,
)
from megamamba.parallel.tensor.tensor_parallel import SEQ_DIM, TensorParallel, divide

__all__ = [
    "SEQ_DIM",
    "ColumnParallelLinear",
    "CommRecord",
    "CommTotals",
    "Component",
    "RowParallelLinear",
    "Shard",
    "TensorParallel",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "assemble_full",
    "comm_counter",
    "component_parameters",
    "copy_to_tp_region",
    "divide",
    "full_key",
    "full_tensors",
    "gather_from_sequence_region",
    "gather_from_tp_region",
    "gather_whole_sequence",
    "gather_full",
    "in_component_order",
    "load_full_tensors",
    "local_shard",
    "mark",
    "parallel_linear",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_sequence_region",
    "scatter_to_tp_region",
    "split",
    "start_sequence_gather",
    "tp_padded_vocab_size",
    "vocab_parallel_cross_entropy",
]
