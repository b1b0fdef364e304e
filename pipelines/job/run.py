"""A run from its plan: the start-up checks that need the process group, the trainer built and its weights set
(resumed, initialised from a folder, or fresh), the start-up announced, and the training loop run.
"""

import argparse
import dataclasses
import logging

from megamamba.observe import console_log
from megamamba.observe.run_console import count_parameters, startup_summary
from megamamba.parallel.groups import shutdown_distributed, topology
from megamamba.parallel.placement import check_placement
from megamamba.pipelines.config.run_plan import RunPlan, optimizer_flags
from megamamba.pipelines.job import checkpointing, init_from
from megamamba.pipelines.job.resume import ResumeFlags, fresh, resume_line, resumed_run, run_stream
from megamamba.pipelines.loop.agreement import agree
from megamamba.pipelines.loop.engine import build_trainer
from megamamba.pipelines.loop.training import LoopSettings, StartedRun, TrainingLoop
from megamamba.pipelines.memory.fit import check_at_start
from megamamba.pipelines.memory.plan import RunShape, plan_memory

log = logging.getLogger(__name__)


def check_start(args: argparse.Namespace, plan: RunPlan) -> tuple:
    """The checks a run makes once its process group is up (collective): the ranks' placement on the nodes,
    the start-up memory plan against the devices, the save directory's lock. (The memory plan's lines, the lock
    or None); PlacementError, MemoryPlanError or CheckpointError say what stops the run."""
    layout, flags = plan.layout, plan.flags
    check_placement(topology(layout.tp, layout.pp, layout.dp, layout.cp))
    shape = RunShape.of_run(
        plan.model,
        layout,
        plan.engine_config,
        args.seq_length // layout.cp,
        flags.partition_method,
        flags.checkpoint_interval,
        flags.sequence_parallel,
    )
    memory_lines = check_at_start(plan_memory(shape), args.no_memory_check)
    return memory_lines, checkpointing.lock_save_dir(args.save, plan.model) if args.save else None


def resume_flags(args: argparse.Namespace) -> ResumeFlags:
    return ResumeFlags(
        args.train_samples,
        args.override_data_check,
        args.override_opt_param_scheduler,
        args.no_load_optim,
        args.no_load_rng,
        optimizer_flags(args),
    )


def start_run(args: argparse.Namespace, plan: RunPlan) -> StartedRun:
    """The trainer built and its weights set: resumed from --load, initialised from --init-from, or fresh (a
    checkpoint that cannot be used: CheckpointError)."""
    load, initial = init_from.sources(args.init_from, args.finetune, args.load)
    resume = checkpointing.open_for_run(load, args.save, plan.model)
    stream = run_stream(plan.data, args.tokenizer) if args.save or resume else None
    global_batch = plan.layout.global_batch_size
    run_start = (
        fresh(plan.train_iters, plan.schedule, global_batch)
        if not resume
        else resumed_run(
            resume, resume_flags(args), stream, global_batch, plan.train_iters, plan.schedule, plan.ds_config
        )
    )
    settings = dataclasses.replace(plan.optimizer, schedule=run_start.schedule)
    source = init_from.open_source(*initial, plan.model) if initial and not resume else None
    trainer = build_trainer(
        plan.layout,
        plan.model,
        plan.engine_config,
        settings,
        args.seed,
        plan.flags.partition_method,
        plan.flags.checkpoint_interval,
        plan.flags.sequence_parallel,
        seq_length=args.seq_length,
        compile_backend=args.torch_compile,
    )
    if args.save or load:
        checkpointing.check_trainer(trainer)
    if resume:
        checkpointing.load(trainer, resume, plan.model, not args.no_load_optim, not args.no_load_rng)
    if source:
        init_from.load_weights(trainer, source)
    return StartedRun(trainer, resume, run_start, stream, initial, source)


def announce(args: argparse.Namespace, plan: RunPlan, run: StartedRun, loop: TrainingLoop) -> None:
    """The start-up summary, and what the weights came from (collective: every rank counts its stage)."""
    low, high = agree([-loop.stage_params, loop.stage_params], op="max")
    if loop.rank != 0:
        return
    console_log.show(
        "\n".join(
            startup_summary(
                model=plan.model,
                layout=plan.layout,
                seq_length=args.seq_length,
                train_iters=loop.train_iters,
                schedule=run.run_start.lr_plan,
                engine_config=plan.engine_config,
                data=plan.data,
                total_params=count_parameters(plan.model),
                stage_params=(int(-low), int(high)),
                save=args.save,
                load=args.load,
                save_interval=args.save_interval,
                keep_last=args.keep_last,
            )
        )
    )
    if run.resume:
        if run.run_start.warning:
            log.warning(run.run_start.warning)
        log.info(resume_line(run.resume.path, run.run_start))
        if run.initial:
            log.info(f"{run.initial[0]} not used: --load found {run.resume.path} to resume")
    if run.source:
        log.info(init_from.startup_line(run.source))


def loop_settings(args: argparse.Namespace, plan: RunPlan) -> LoopSettings:
    return LoopSettings(
        args.seq_length,
        args.log_interval,
        args.eval_interval,
        args.eval_iters,
        args.save,
        args.save_interval,
        args.keep_last,
        args.peak_tflops,
        args.metrics_jsonl,
        args.max_skipped_steps,
        args.loss_spike_factor,
        args.step_timeout,
        plan.eval_tasks,
        {**vars(args), "layout_flags": dataclasses.asdict(plan.flags)},
    )


def run_training(args: argparse.Namespace, plan: RunPlan, job_start: float) -> dict:
    """The trainer built, the start-up announced, every step run; this rank's summary (NonFiniteSteps when the
    run stops on skipped steps)."""
    run = start_run(args, plan)
    loop = TrainingLoop(loop_settings(args, plan), plan.model, plan.layout, plan.data, plan.monitors, run, job_start)
    announce(args, plan, run, loop)
    summary = loop.run()
    shutdown_distributed()
    loop.tasks.poll(wait=True)  # after the group is gone: an evaluation may outlast any collective's timeout
    return summary
