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
    ROOT,
    TRAIN_PY,
    kill_node,
    node_alive,
    read_metrics,
    start_node,
    stop_all,
    wait_for,
    wait_node,
    write_hostfile,
)
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
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        lines = [line for line in two_node_run["outputs"][node].splitlines() if "optimizer state bytes" in line]
        assert sorted(int(line.split("rank ")[1].split(":")[0]) for line in lines) == list(ranks), lines


def test_the_startup_table_shows_each_nodes_ranks_and_coordinates(tmp_path):
    codes, outputs = run_nodes(tmp_path, [2, 2], PLACEMENT_ENTRY, [2, 2], timeout=120)
    assert codes == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    lines = outputs[0].splitlines()
    first = lines.index("placement: 4 ranks on 2 node(s), dp=1 tp=2 pp=2; every tensor-parallel group inside one node")
    rows = [line.split()[1:] for line in lines[first + 2:first + 6]]  # host name, then node rank onwards
    assert rows == [["0", "0", "0", "0", "0", "0"], ["0", "1", "1", "0", "1", "0"],
                    ["1", "2", "0", "0", "0", "1"], ["1", "3", "1", "0", "1", "1"]], lines[first:first + 7]
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
    assert [out.count(message) for out in outputs] == [2, 1], outputs[0][-2000:] + outputs[1][-2000:]
    assert not any("| loss " in out for out in outputs)


@pytest.mark.parametrize("victim", [1, 0], ids=["worker-node-killed", "master-node-killed"])
def test_killing_every_process_of_one_node_makes_the_other_node_exit_nonzero_within_60s(tmp_path, victim):
    nodes = launch_nodes(tmp_path, [2, 2], TRAIN_PY, train_args(tmp_path, train_iters=500))
    try:
        wait_for(lambda: len(read_metrics(tmp_path / "metrics.jsonl")) >= 2, 240, "two training steps")
        kill_node(nodes[victim])
        survivor = nodes[1 - victim]
        start = time.monotonic()
        try:
            elapsed = wait_for(lambda: not node_alive(survivor), EXIT_WITHIN_S, f"node {survivor.rank} exits")
        except TimeoutError:
            pytest.fail(f"node {survivor.rank} still running {EXIT_WITHIN_S} s after node {victim} was killed:\n"
                        + survivor.output()[-3000:])
        print(f"node {victim} killed: node {survivor.rank} gone after {time.monotonic() - start:.1f} s, "
              f"launcher status {survivor.proc.returncode}")
        assert survivor.proc.returncode not in (0, None), survivor.output()[-3000:]
        assert elapsed < EXIT_WITHIN_S
    finally:
        stop_all(nodes)
