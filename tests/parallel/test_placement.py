"""Placement check on synthetic host lists: tensor groups across nodes refused, good layouts accepted, the table.

Places are built as DeepSpeed's launcher assigns them: each node in hostfile order gets the next
`slots` global ranks, local ranks 0..slots-1, its node rank in CROSS_RANK.
"""

import pytest
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megamamba.parallel.placement import (
    PlacementError,
    RankPlace,
    check_tensor_groups,
    cross_node_stage_pairs,
    placement_report,
    placement_table,
)


def launcher_places(slots_per_host: dict) -> list:
    places = []
    for node_rank, (host, slots) in enumerate(slots_per_host.items()):
        first = len(places)
        places += [RankPlace(first + local, host, node_rank, local) for local in range(slots)]
    return places


def topology(dp, tp, pp):
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


def test_tensor_group_across_two_nodes_is_refused_naming_ranks_hosts_rule_and_fix():
    places = launcher_places({"node-a": 3, "node-b": 1})
    with pytest.raises(PlacementError) as e:
        check_tensor_groups(places, topology(1, 2, 2))
    message = str(e.value)
    assert "tensor-parallel group ranks [2, 3] spans 2 nodes" in message
    assert "rank 2 on node-a (node 0), rank 3 on node-b (node 1)" in message
    assert "must sit inside one node" in message
    assert "multiple of --tensor-parallel-size 2" in message
    assert "node-a (node 0): 3, node-b (node 1): 1" in message
    assert "slots=<multiple of 2>" in message


def test_same_host_name_with_two_launcher_node_ranks_counts_as_two_nodes():
    places = [RankPlace(0, "vm", 0, 0), RankPlace(1, "vm", 1, 0), RankPlace(2, "vm", 1, 1), RankPlace(3, "vm", 1, 2)]
    with pytest.raises(PlacementError, match=r"ranks \[0, 1\] spans 2 nodes"):
        check_tensor_groups(places, topology(2, 2, 1))


def test_tensor_group_of_eight_over_two_four_slot_nodes_is_refused():
    with pytest.raises(PlacementError, match=r"ranks \[0, 1, 2, 3, 4, 5, 6, 7\] spans 2 nodes"):
        check_tensor_groups(launcher_places({"a": 4, "b": 4}), topology(1, 8, 1))


@pytest.mark.parametrize(
    "slots, layout",
    [
        ({"a": 2, "b": 2}, (1, 2, 2)),
        ({"a": 4, "b": 4}, (2, 2, 2)),
        ({"a": 4, "b": 4}, (1, 4, 2)),
        ({"a": 8}, (1, 8, 1)),
        ({"a": 1, "b": 1, "c": 1, "d": 1}, (2, 1, 2)),
        ({"a": 2, "b": 4, "c": 2}, (2, 2, 2)),
    ],
)
def test_tensor_groups_inside_nodes_are_accepted(slots, layout):
    check_tensor_groups(launcher_places(slots), topology(*layout))


def test_a_host_list_that_does_not_match_the_world_size_is_refused():
    with pytest.raises(PlacementError, match="world size 8"):
        check_tensor_groups(launcher_places({"a": 2, "b": 2}), topology(2, 2, 2))


def test_cross_node_pipeline_boundaries_are_listed_as_sender_receiver_pairs():
    places = launcher_places({"a": 2, "b": 2})
    assert cross_node_stage_pairs(places, topology(1, 2, 2)) == [(0, 2), (1, 3)]
    assert cross_node_stage_pairs(launcher_places({"a": 4}), topology(1, 2, 2)) == []


def test_table_has_host_node_rank_local_rank_and_coordinate_of_every_rank():
    table = placement_table(launcher_places({"node-a": 2, "node-b": 2}), topology(1, 2, 2))
    rows = [line.split() for line in table.splitlines()]
    assert rows == [
        ["host", "node", "rank", "local_rank", "dp", "tp", "pp"],
        ["node-a", "0", "0", "0", "0", "0", "0"],
        ["node-a", "0", "1", "1", "0", "1", "0"],
        ["node-b", "1", "2", "0", "0", "0", "1"],
        ["node-b", "1", "3", "1", "0", "1", "1"],
    ]


def test_table_coordinates_are_the_topology_coordinates_for_dp_tp_pp_2_2_2():
    topo = topology(2, 2, 2)
    rows = [line.split() for line in placement_table(launcher_places({"a": 4, "b": 4}), topo).splitlines()[1:]]
    for row in rows:
        c = topo.get_coord(int(row[2]))
        assert (int(row[4]), int(row[5]), int(row[6])) == (c.data, c.model, c.pipe), row


def test_table_marks_ranks_not_started_by_the_deepspeed_launcher():
    places = [RankPlace(0, "h", None, 0), RankPlace(1, "h", None, 1)]
    assert placement_table(places, topology(2, 1, 1)).splitlines()[1].split() == ["h", "-", "0", "0", "0", "0", "0"]


def test_report_summarises_the_layout_and_the_cross_node_pipeline_boundaries():
    report = placement_report(launcher_places({"a": 2, "b": 2}), topology(1, 2, 2))
    lines = report.splitlines()
    assert lines[0] == "placement: 4 ranks on 2 node(s), dp=1 tp=2 pp=2; every tensor-parallel group inside one node"
    assert lines[-1].endswith("rank 0 -> 2, rank 1 -> 3")
    assert len(lines) == 1 + 5 + 1


def test_report_refuses_what_the_check_refuses():
    with pytest.raises(PlacementError):
        placement_report(launcher_places({"a": 3, "b": 1}), topology(1, 2, 2))


def test_the_hostfile_example_parses_and_fits_the_layout_its_comment_shows():
    from deepspeed.launcher.runner import fetch_hostfile

    from train_entry import ROOT

    slots = fetch_hostfile(str(ROOT / "launch/hostfile.example"))
    assert dict(slots) == {"node1": 8, "node2": 8}
    check_tensor_groups(launcher_places(slots), topology(1, 8, 2))
