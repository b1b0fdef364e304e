"""The start-up memory plan's parameter, gradient and optimizer-state figures are what the built
engine holds, for the plain and the pipeline engine, ZeRO 0, 1 and 2, tensor, pipeline and expert parallel,
Mamba models, a hybrid (Mamba-2, attention and MLP layers) and a mixture-of-experts hybrid.

Measured on each rank of a directly spawned run (tiny 3-layer models, gloo): parameters as the
bytes of the distinct storages behind the module's parameters (ZeRO's padded flat buffers
included), gradients as the `.grad` bytes when DeepSpeed starts reducing them, optimizer state
as launch/train.py measures it (`optimizer_state_bytes` after step 0), ZeRO's reduce buckets while
one is reduced (5e8 float32 elements by default; two with the pipeline engine). ZeRO-2's gradients
live in its bucket (measured as their storage: 2e9 bytes); their partition is an estimate.
"""

import json
import os
from pathlib import Path

import pytest

from distributed import run_ranks
from megamamba.pipelines.memory.plan import RunShape, plan_memory
from train_entry import load_train_script

SEQ = 32


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _measure(argv, extensions_dir):
    """(measured, planned) (parameters, gradients, optimizer state) bytes of this rank after step 0."""
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir
    script = load_train_script()
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from megamamba.parallel.groups import init_distributed, shutdown_distributed
    from megamamba.pipelines.loop.engine import build_trainer

    args = script.parse_args(argv)
    plan = script.prepare(args, int(os.environ["WORLD_SIZE"]))
    layout = plan.layout
    shape = RunShape.of_run(
        plan.model,
        layout,
        plan.engine_config,
        args.seq_length,
        args.partition_method,
        args.checkpoint_activations_interval,
        args.sequence_parallel,
    )
    init_distributed()
    trainer = build_trainer(
        layout,
        plan.model,
        plan.engine_config,
        plan.optimizer,
        args.seed,
        args.partition_method,
        args.checkpoint_activations_interval,
        args.sequence_parallel,
        seq_length=args.seq_length,
    )
    params = [p for _, _, p in trainer.named_parameters()]
    grads, buckets = [], [0]
    # The trainer keeps its engine and optimizer private: this rank (its own process) patches their classes.
    reduce, reduce_bucket = DeepSpeedEngine.allreduce_gradients, DeepSpeedZeroOptimizer.reduce_ipg_grads

    def measured_reduce(engine, *a, **kw):
        grads.append(_storage_bytes(p.grad for p in params if p.grad is not None))
        return reduce(engine, *a, **kw)

    def measured_bucket(zero, *a, **kw):  # ZeRO 1/2: the bucket is alive while it is reduced
        buckets.append(sum(_storage_bytes(b.buffer) for b in zero.ipg_buckets.values()))
        return reduce_bucket(zero, *a, **kw)

    DeepSpeedEngine.allreduce_gradients = measured_reduce
    DeepSpeedZeroOptimizer.reduce_ipg_grads = measured_bucket
    trainer.train_step(plan.data.train.micro_batches(0, trainer.dp_rank, layout.dp, layout.micro_batch_size))
    measured = (_storage_bytes(params), max(grads, default=0), trainer.optimizer_state_bytes(), max(buckets))
    stage = plan_memory(shape).stages[trainer.pipe_rank]
    shutdown_distributed()
    return measured, (stage.parameters, stage.gradients, stage.optimizer, stage.buffers)


ODD = {"d_model": 63}  # groups whose sizes are not multiples of 2 x dp: ZeRO pads them
HYBRID = {
    "hybrid_layer_pattern": "M*-",
    "d_intermediate": 96,
    "mlp_activation": "squared_relu",
    "attn_cfg": {"num_heads": 4, "num_heads_kv": 2, "head_dim": 16, "rotary_emb_dim": 8, "causal": True},
}

MOE = {  # 6 experts, 3 on each rank of an expert-parallel pair: each rank's expert group padded for 2 ranks
    "hybrid_layer_pattern": "ME*",
    "attn_cfg": {"num_heads": 4, "num_heads_kv": 2, "head_dim": 16, "rotary_emb_dim": 8, "causal": True},
    "moe_cfg": {"num_experts": 6, "top_k": 2, "ffn_hidden_size": 17, "shared_expert_ffn_hidden_size": 8},
}


def _argv(train_runs, tmp_path, mixer, zero, flags, changes=None):
    model = train_runs.model_config(mixer)
    if changes:
        model = tmp_path / "model.json"
        model.write_text(json.dumps({**json.loads(Path(train_runs.model_config(mixer)).read_text()), **changes}))
    return [
        "--deepspeed_config",
        train_runs.ds_config(zero_optimization={"stage": zero}),
        "--model-config",
        str(model),
        "--train-iters",
        "1",
        "--seq-length",
        str(SEQ),
        *flags,
    ]


def _ranks(argv, world):
    return run_ranks(
        _measure, world, args=(argv, os.environ["TORCH_EXTENSIONS_DIR"]), init_process_group=False, timeout=300
    )


CASES = [
    # world, mixer, ZeRO stage, flags, model changes
    (1, "mamba2", 0, [], None),
    (2, "mamba1", 1, [], ODD),
    (2, "mamba2", 0, ["--tensor-parallel-size", "2"], None),
    (2, "mamba1", 1, ["--pipeline-parallel-size", "2", "--checkpoint-activations-interval", "1"], None),
    (
        8,
        "mamba2",
        1,
        [
            "--tensor-parallel-size",
            "2",
            "--pipeline-parallel-size",
            "2",
            "--partition-method",
            "parameters",
            "--checkpoint-activations-interval",
            "1",
        ],
        HYBRID,
    ),
    (4, "mamba2", 1, ["--tensor-parallel-size", "2"], HYBRID),
    (4, "mamba2", 1, ["--expert-model-parallel-size", "2"], MOE),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, mixer, zero, flags, changes",
    CASES,
    ids=[
        f"{m}-world{w}-zero{z}-{' '.join(f)}{'-hybrid' if c is HYBRID else '-moe' if c is MOE else '-odd' if c else ''}"
        for w, m, z, f, c in CASES
    ],
)
def test_planned_parameters_gradients_optimizer_state_and_buckets_are_what_the_engine_holds(
    train_runs, tmp_path, world, mixer, zero, flags, changes
):
    ranks = _ranks(_argv(train_runs, tmp_path, mixer, zero, flags, changes), world)
    for rank, (measured, planned) in enumerate(ranks):
        print(
            f"{mixer} world {world} ZeRO {zero} {' '.join(flags)} {changes or ''} rank {rank}: measured {measured}, "
            f"planned {planned} (parameters, gradients, optimizer state, ZeRO's reduce buckets: bytes)"
        )
        assert measured[:3] == planned[:3], (rank, measured, planned)
        if zero:  # without ZeRO, DeepSpeed's flattened all-reduce buffer lives inside one call: estimated
            assert measured[3] == planned[3], (rank, measured, planned)


@pytest.mark.slow
def test_zero2_planned_parameters_optimizer_state_and_bucket_are_what_the_engine_holds(train_runs, tmp_path):
    """ZeRO-2 reduces gradients through its bucket during the backward: their partition is estimated. A hybrid
    of odd width (d_model 63, Mamba-2 heads of 18 channels), so ZeRO pads its groups."""
    ssm = {"layer": "Mamba2", "d_state": 16, "headdim": 18, "chunk_size": 32}
    argv = _argv(train_runs, tmp_path, "mamba2", 2, [], {**HYBRID, **ODD, "ssm_cfg": ssm})
    for rank, (measured, planned) in enumerate(_ranks(argv, 2)):
        print(f"ZeRO 2 odd hybrid rank {rank}: measured {measured}, planned {planned}")
        exact = (0, 2, 3)  # parameters, optimizer state, bucket
        assert [measured[i] for i in exact] == [planned[i] for i in exact], (rank, measured, planned)
