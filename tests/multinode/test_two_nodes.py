"""Two simulated nodes on this machine: two concurrent `deepspeed --hostfile H --no_ssh --node_rank 0/1` launchers.

This is how a scheduler (SLURM, Kubernetes) starts a DeepSpeed job: one launcher per node, all
given the same hostfile, master address and port. Both nodes share this machine's host name;
the launcher's node rank tells them apart. World 4: (dp, tp, pp) = (1, 2, 2), tensor groups
inside the nodes, the pipeline boundary across them.
"""

import time

import pytest

from distributed import free_port
from harness import (
    kill_node,
    node_alive,
    placement_rows,
    start_node,
    stop_all,
    wait_for,
    wait_node,
    write_hostfile,
)
from train_entry import ROOT, TRAIN_PY, read_metrics
from training_runs import assert_same_curve, train_args

pytestmark = pytest.mark.slow

PLACEMENT_ENTRY = ROOT / "tests/multinode/placement_entry.py"
EXIT_WITHIN_S = 60


def launch_nodes(tmp, slots, script, args):
    hostfile = write_hostfile(tmp / "hostfile", {f"node{i}": n for i, n in enumerate(slots)})
    port = free_port()
    return [start_node(hostfile, r, port, script, args, cwd=tmp, log=tmp / f"node{r}.log") for r in range(len(slots))]


def run_nodes(tmp, slots, script, args, timeout=300):
    nodes = launch_nodes(tmp, slots, script, args)
    try:
        codes = [wait_node(n, timeout) for n in nodes]
    finally:
        stop_all(nodes)
    return codes, [n.output() for n in nodes]


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_nodes")
    start = time.monotonic()
    codes, outputs = run_nodes(tmp, [2, 2], TRAIN_PY, train_args(tmp))
    print(f"two simulated nodes x 2 processes, 5 steps: {time.monotonic() - start:.1f} s")
    return {"codes": codes, "outputs": outputs, "records": read_metrics(tmp / "metrics.jsonl")}


def test_two_nodes_train_the_one_node_float32_loss_curve_bit_for_bit(two_node_run):
    assert two_node_run["codes"] == [0, 0], two_node_run["outputs"][0][-3000:] + two_node_run["outputs"][1][-3000:]
    assert_same_curve(two_node_run["records"], "2 nodes x 2 processes (--no_ssh --node_rank)")


def test_each_node_runs_its_own_two_ranks(two_node_run):
    assert placement_rows(two_node_run["outputs"][0], 4) == [(0, 0), (0, 1), (1, 2), (1, 3)]


def test_the_startup_table_shows_each_nodes_ranks_and_coordinates(two_node_run):
    outputs = two_node_run["outputs"]
    lines = outputs[0].splitlines()
    first = lines.index("placement: 4 ranks on 2 node(s), dp=1 tp=2 pp=2; every tensor-parallel group inside one node")
    rows = [line.split()[1:] for line in lines[first + 2 : first + 6]]  # host name, then node rank onwards
    assert rows == [
        ["0", "0", "0", "0", "0", "0"],
        ["0", "1", "1", "0", "1", "0"],
        ["1", "2", "0", "0", "0", "1"],
        ["1", "3", "1", "0", "1", "1"],
    ], lines[first : first + 7]
    assert "rank 0 -> 2, rank 1 -> 3" in lines[first + 6]
    assert "placement:" not in outputs[1], "the table is printed once, by global rank 0"


def test_a_tensor_group_across_the_nodes_is_refused_at_startup_on_every_rank(tmp_path):
    codes, outputs = run_nodes(tmp_path, [3, 1], PLACEMENT_ENTRY, [2, 2], timeout=120)
    assert codes[0] != 0 and codes[1] != 0, codes
    message = "placement_entry.py: error: tensor-parallel group ranks [2, 3] spans 2 nodes"
    assert [out.count(message) for out in outputs] == [3, 1], outputs[0][-2000:] + outputs[1][-2000:]


def test_a_world_size_that_does_not_fit_tp_times_pp_is_refused_before_training_on_both_nodes(tmp_path):
    codes, outputs = run_nodes(tmp_path, [2, 1], TRAIN_PY, train_args(tmp_path), timeout=120)
    assert codes == [2, 2], codes
    message = "train.py: error: world size 3 is not a multiple of tensor x pipeline parallel size 2 x 2 = 4"
    # Each node shows the refusal; the launcher ends a node's other ranks as soon as one exits non-zero
    # (DeepSpeed 0.19.8 launch.py, sigkill_handler), so node 0's second rank may not get to print it.
    counts = [out.count(message) for out in outputs]
    assert 1 <= counts[0] <= 2 and counts[1] == 1, (counts, outputs[0][-2000:] + outputs[1][-2000:])
    assert not any("| loss " in out for out in outputs)


def kill_one_node_in_training(tmp, victim, args, after_step):
    """Start 2 nodes, SIGKILL every process of node `victim` once step `after_step` is logged, wait for the other.

    Returns (the nodes, seconds from the kill until the other node's last process is gone, or None
    if it is still running EXIT_WITHIN_S seconds later)."""
    nodes = launch_nodes(tmp, [2, 2], TRAIN_PY, args)
    metrics = tmp / "metrics.jsonl"
    try:
        wait_for(
            lambda: any(r["step"] >= after_step for r in read_metrics(metrics)),
            240,
            f"step {after_step}",
            interval=0.05,
        )
        kill_node(nodes[victim])
        survivor = nodes[1 - victim]
        start = time.monotonic()
        try:
            wait_for(lambda: not node_alive(survivor), EXIT_WITHIN_S, f"node {survivor.rank} exits")
            elapsed = time.monotonic() - start
        except TimeoutError:
            elapsed = None
        print(
            f"node {victim} killed after step {after_step}: node {survivor.rank} "
            + (f"gone after {elapsed:.1f} s" if elapsed is not None else f"still running after {EXIT_WITHIN_S} s")
            + f", launcher status {survivor.proc.poll()}"
        )
    finally:
        stop_all(nodes)
    return nodes, elapsed


SAVE_INTERVAL, RESUME_ITERS = 3, 12


@pytest.fixture(scope="module")
def killed_worker_node(tmp_path_factory):
    """A 12-step run checkpointing every 3 steps; node 1 killed once step 3 is logged (checkpoint 3 exists)."""
    tmp = tmp_path_factory.mktemp("killed_worker_node")
    save = tmp / "checkpoints"
    args = train_args(tmp, RESUME_ITERS, ("--save", save, "--save-interval", SAVE_INTERVAL))
    nodes, elapsed = kill_one_node_in_training(tmp, 1, args, after_step=SAVE_INTERVAL)
    return {
        "dir": tmp,
        "save": save,
        "nodes": nodes,
        "elapsed": elapsed,
        "records": read_metrics(tmp / "metrics.jsonl"),
        "latest": (save / "latest").read_text().strip(),
    }


def assert_other_node_exited_nonzero_in_time(node, elapsed):
    assert elapsed is not None, (
        f"node {node.rank} still running {EXIT_WITHIN_S} s after the other was killed:\n" + node.output()[-3000:]
    )
    assert node.proc.returncode != 0, node.output()[-3000:]


def test_killing_every_process_of_the_worker_node_ends_the_master_node_nonzero_within_60s(killed_worker_node):
    assert_other_node_exited_nonzero_in_time(killed_worker_node["nodes"][0], killed_worker_node["elapsed"])


def test_killing_every_process_of_the_master_node_ends_the_worker_node_nonzero_within_60s(tmp_path):
    nodes, elapsed = kill_one_node_in_training(tmp_path, 0, train_args(tmp_path, train_iters=500), after_step=1)
    assert_other_node_exited_nonzero_in_time(nodes[1], elapsed)


def test_restarting_both_nodes_resumes_from_the_last_checkpoint_and_repeats_its_steps_exactly(killed_worker_node):
    killed = killed_worker_node
    assert killed["latest"] == f"step_{SAVE_INTERVAL:06d}", killed["latest"]
    restart = killed["dir"] / "restart"
    restart.mkdir()
    args = train_args(
        restart, RESUME_ITERS, ("--save", killed["save"], "--load", "auto", "--save-interval", SAVE_INTERVAL)
    )
    codes, outputs = run_nodes(restart, [2, 2], TRAIN_PY, args)
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    resumed = read_metrics(restart / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(SAVE_INTERVAL, RESUME_ITERS)), resumed
    before = {r["step"]: r for r in killed["records"]}
    repeated = [r for r in resumed if r["step"] in before]
    assert repeated, f"the killed run logged steps {sorted(before)}: none after the checkpoint"
    for r in repeated:
        assert (r["loss"], r["grad_norm"]) == (before[r["step"]]["loss"], before[r["step"]]["grad_norm"]), r["step"]
    print(
        f"resumed at step {SAVE_INTERVAL} from {killed['latest']}; steps {[r['step'] for r in repeated]} "
        "repeated bit for bit"
    )
