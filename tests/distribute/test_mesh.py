"""The rank grid (tfbig.distribute.mesh): coordinates, groups, placement orders, bad layouts."""
import itertools

import pytest

from tfbig.distribute.mesh import Mesh, placement_order


def test_cluster_order_puts_tensor_ranks_adjacent():
    mesh = Mesh.build(8, tensor=2, pipeline=2)
    assert (mesh.data, mesh.pipeline, mesh.tensor, mesh.order) == (2, 2, 2, "DPT")
    assert mesh.coords(5) == {"data": 1, "pipeline": 0, "context": 0, "tensor": 1}
    assert mesh.groups("tensor") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.groups("pipeline") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert mesh.groups("data") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_spread_order_reverses_the_axes():
    mesh = Mesh.build(8, tensor=2, pipeline=2, placement="spread")
    assert mesh.order == "TPD"
    assert mesh.groups("data") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.groups("tensor") == [(0, 4), (1, 5), (2, 6), (3, 7)]


@pytest.mark.parametrize("order", ["".join(p) for p in itertools.permutations("DPT")])
def test_coords_and_rank_of_are_inverse_for_every_order(order):
    mesh = Mesh.build(24, tensor=2, pipeline=3, placement=order)
    seen = set()
    for rank in range(mesh.size):
        c = mesh.coords(rank)
        assert mesh.rank_of(**c) == rank
        seen.add((c["data"], c["pipeline"], c["tensor"]))
        for axis in ("data", "pipeline", "tensor"):
            group = mesh.group(axis, rank)
            assert rank in group and len(group) == getattr(mesh, axis)
            # along one axis only that axis' coordinate changes
            others = [{k: v for k, v in mesh.coords(r).items() if k != axis} for r in group]
            assert all(o == others[0] for o in others)
    assert len(seen) == 24


def test_mics_partition_and_replica_groups():
    mesh = Mesh.build(8, shard_degree=4)
    assert mesh.groups("partition") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert mesh.groups("replica") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    whole = Mesh.build(8)  # default: one partition group over the whole data axis
    assert whole.shard_degree == 8 and whole.groups("partition") == [tuple(range(8))]
    assert whole.groups("replica") == [(r,) for r in range(8)]


def test_partition_groups_live_inside_the_data_axis():
    mesh = Mesh.build(8, tensor=2, shard_degree=2)  # data 4
    assert mesh.groups("partition") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert mesh.groups("replica") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_process_sets_cover_every_group_once():
    mesh = Mesh.build(8, tensor=2, pipeline=2)
    sets = mesh.process_set_ranks()
    assert len(sets) == len(set(sets))
    for axis in ("data", "pipeline", "tensor"):
        assert all(g in sets for g in mesh.groups(axis))
    deep = Mesh.build(4, pipeline=4)
    assert {(0, 1), (1, 2), (2, 3)} <= set(deep.process_set_ranks())  # adjacent stage pairs


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=6, tensor=4), ["--tensor_parallel=4", "6"]),
    (dict(world_size=8, pipeline=3), ["--pipeline_stages=3", "8"]),
    (dict(world_size=8, shard_degree=3), ["--shard_degree=3", "8"]),
    (dict(world_size=8, tensor=0), ["--tensor_parallel=0"]),
])
def test_bad_layouts_name_the_flag(kwargs, words):
    with pytest.raises(ValueError) as error:
        Mesh.build(**kwargs)
    assert all(w in str(error.value) for w in words)


def test_placement_orders():
    assert placement_order("cluster") == "DPT" and placement_order("spread") == "TPD"
    assert placement_order("tdp") == "TDP"
    with pytest.raises(ValueError, match="--placement='DPX'"):
        placement_order("DPX")


def test_describe_lists_every_rank():
    text = Mesh.build(4, tensor=2).describe()
    assert "data 2 x pipeline 1 x tensor 2" in text
    assert "rank 3: data 1 pipeline 0 tensor 1" in text


def test_model_groups_hold_one_copy_of_the_model_each():
    mesh = Mesh.build(8, tensor=2, pipeline=2)  # data 2: two copies of the model
    assert mesh.groups("model") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert all(g in mesh.process_set_ranks() for g in mesh.groups("model"))
    spread = Mesh.build(8, tensor=2, pipeline=2, placement="spread")
    assert spread.groups("model") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    pipeline_only = Mesh.build(4, pipeline=2)  # no tensor axis: the pipeline groups
    assert pipeline_only.groups("model") == pipeline_only.groups("pipeline")


def test_the_context_axis_sits_just_outside_tensor():
    mesh = Mesh.build(8, tensor=2, context=2)  # data 2
    assert mesh.data == 2 and mesh.coords(3) == {"data": 0, "pipeline": 0, "context": 1,
                                                 "tensor": 1}
    assert mesh.groups("context") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert mesh.groups("data") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.group("model", 2) == (2, 3)  # a context rank holds a whole model copy (x TP)
    for rank in range(mesh.size):
        assert mesh.rank_of(**mesh.coords(rank)) == rank
    assert "context groups: [(0, 2), (1, 3), (4, 6), (5, 7)]" in mesh.describe()
    with pytest.raises(ValueError, match="--context_parallel=3 x --tensor_parallel=1 = 3 "
                                         "does not divide 4"):
        Mesh.build(4, context=3)


def test_expert_groups_are_consecutive_data_ranks_and_their_replicas_stride_over_them():
    mesh = Mesh.build(8, expert=2)
    assert mesh.groups("expert") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.groups("expert_replica") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert {(0, 1), (1, 3, 5, 7)} <= set(mesh.process_set_ranks())
    with_tensor = Mesh.build(8, tensor=2, expert=2)  # data 4: experts over data ranks 0-1, 2-3
    assert with_tensor.group("expert", 0) == (0, 2) and with_tensor.group("expert", 5) == (5, 7)
    with pytest.raises(ValueError, match="--expert_parallel=3 does not divide the 8"):
        Mesh.build(8, expert=3)
