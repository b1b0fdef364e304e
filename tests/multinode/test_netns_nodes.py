"""Two simulated hosts with their own network stacks and host names (ip netns + veth, 10.200.0.1 / .2).

Closer to two machines than two launchers on loopback: each node has its own host name, its own
address and interface, and gloo must be told which interface to use (GLOO_SOCKET_IFNAME);
a link can be cut without any connection being reset, as when a machine or switch dies.
Then no collective fails by itself until gloo's timeout (DeepSpeed's default: 10 minutes); the
trainer's --step-timeout watchdog ends every stalled rank sooner.
"""

import time

import pytest

import netns
from harness import (
    launcher_env,
    node_alive,
    start_node,
    stop_all,
    wait_for,
    wait_node,
    write_hostfile,
)
from train_entry import TRAIN_PY, read_metrics
from training_runs import assert_same_curve, train_args

pytestmark = [pytest.mark.slow, pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))]

MASTER_PORT = 29500  # the namespaces have nothing else listening
STEP_TIMEOUT_S = 20
EXIT_WITHIN_S = 60


def start_nodes(tmp, hosts, args, **env):
    hostfile = write_hostfile(tmp / "hostfile", {h.name: 2 for h in hosts})
    return [
        start_node(
            hostfile,
            r,
            MASTER_PORT,
            TRAIN_PY,
            args,
            cwd=tmp,
            log=tmp / f"{h.name}.log",
            master_addr=hosts[0].address,
            prefix=h.prefix,
            env=launcher_env(GLOO_SOCKET_IFNAME=h.interface, **env),
        )
        for r, h in enumerate(hosts)
    ]


def test_two_hosts_with_their_own_addresses_train_the_one_node_curve_bit_for_bit(tmp_path):
    with netns.two_hosts() as hosts:
        nodes = start_nodes(tmp_path, hosts, train_args(tmp_path))
        try:
            codes = [wait_node(n, 300) for n in nodes]
        finally:
            stop_all(nodes)
    assert codes == [0, 0], nodes[0].output()[-3000:] + nodes[1].output()[-3000:]
    assert_same_curve(read_metrics(tmp_path / "metrics.jsonl"), "2 hosts in network namespaces")


def test_a_cut_link_ends_both_nodes_nonzero_within_60s_through_the_step_timeout(tmp_path):
    """No process dies, so no connection is reset: every rank stalls until its watchdog fires."""
    with netns.two_hosts() as hosts:
        nodes = start_nodes(tmp_path, hosts, train_args(tmp_path, 500, ("--step-timeout", STEP_TIMEOUT_S)))
        try:
            wait_for(lambda: len(read_metrics(tmp_path / "metrics.jsonl")) >= 2, 240, "two training steps")
            netns.set_link(hosts[1], up=False)
            start = time.monotonic()
            for node in nodes:
                try:
                    left = EXIT_WITHIN_S - (time.monotonic() - start)
                    wait_for(lambda node=node: not node_alive(node), left, f"node {node.rank} exits")
                except TimeoutError:
                    pytest.fail(
                        f"node {node.rank} still running {EXIT_WITHIN_S} s after the link was cut:\n"
                        + node.output()[-3000:]
                    )
                print(
                    f"link cut: node {node.rank} gone after {time.monotonic() - start:.1f} s, "
                    f"launcher status {node.proc.returncode}"
                )
                assert node.proc.returncode not in (0, None)
            for node in nodes:
                assert f"no training step finished in {STEP_TIMEOUT_S} s" in node.output(), node.output()[-3000:]
        finally:
            stop_all(nodes)
