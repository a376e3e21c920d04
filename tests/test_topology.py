from __future__ import annotations

import pytest

import mgraph as mg


def test_parse_and_ranks():
    topo = mg.Topology.parse("2x8")
    assert (topo.nodes, topo.gpus_per_node, topo.world_size) == (2, 8, 16)
    assert str(topo) == "2x8"
    assert topo == mg.Topology(2, 8) == mg.Topology(nodes=2, gpus_per_node=8)
    for rank in topo.ranks:
        assert topo.rank(topo.node_of(rank), topo.local_of(rank)) == rank
    assert topo.rail_peer(3, 1) == 11
    assert topo.rail_peers(11) == [3]
    assert topo.node_ranks(1) == list(range(8, 16))


def test_links():
    topo = mg.Topology.parse("2x4")
    assert topo.link(1, 1) == "local"
    assert topo.link(0, 3) == "nvlink"
    assert topo.link(0, 4) == "rdma"
    assert topo.link(2, 7) == "rdma"


@pytest.mark.parametrize("text", ["0x2", "2x0", "2*8", "x8", "", "2x8x1", "-1x2"])
def test_bad_topology(text):
    with pytest.raises(mg.TopologyError) as info:
        mg.Topology.parse(text)
    assert "NODESxGPUS" in str(info.value)


def test_rank_out_of_range():
    with pytest.raises(mg.TopologyError, match="rank 8 is outside topology 2x4"):
        mg.Topology.parse("2x4").node_of(8)


def test_hardware_profile_json_round_trip(tmp_path):
    path = tmp_path / "h200.json"
    mg.H200.save(path)
    again = mg.HardwareProfile.load(path)
    assert again == mg.H200
    assert mg.H200.sms == 132
    assert 700 < mg.H200.tile_gemm_tflops < 850  # calibrate.py on 2x H200: 819 TF/s per tile wave
    assert mg.H200.sm_share(116) == pytest.approx(116 / 132)


def test_hardware_profile_rejects_bad_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"name": "x", "sms": -1}')
    with pytest.raises(Exception, match="sms"):
        mg.HardwareProfile.load(path)
