"""The routing table of the elastic PS tier: bucket placement, minimal moves, compaction, wire form."""
import numpy as np
import pytest

from hybridrec.embedding.buckets import NUM_BUCKETS, bucket_of, static_owners
from hybridrec.embedding.hashing import route
from hybridrec.ps.routing import NO_SERVER, RoutingTable, compact, plan_servers


def test_static_table_splits_buckets_evenly_and_agrees_with_route_for_powers_of_two():
    for n in (1, 2, 3, 7):
        assert np.bincount(static_owners(n)).max() - np.bincount(static_owners(n)).min() <= 1
    keys = np.arange(10_000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for n in (2, 4):  # the pre-bucket placement of these server counts is kept
        np.testing.assert_array_equal(static_owners(n)[bucket_of(keys, 7)], route(keys, 7, n))


def test_scaling_moves_only_the_buckets_a_new_balance_needs():
    two = RoutingTable.static(["a", "b"])
    three = plan_servers(two, ["a", "b", "c"])
    assert three.version == 1 and three.addresses == ("a", "b", "c")
    assert sorted(np.bincount(three.owners)) == [1365, 1365, 1366]
    assert (three.owners != two.owners).sum() == np.bincount(three.owners)[2]  # only c's buckets moved
    back = plan_servers(compact(three), ["a", "c"])
    assert np.bincount(back.owners, minlength=3)[1] == 0  # b leaves: it owns nothing
    final = compact(back)
    assert final.addresses == ("a", "c") and final.version == back.version + 1
    assert (np.array(final.addresses)[final.owners] == np.array(back.addresses)[back.owners]).all()


def test_backups_lie_on_another_server_and_tables_cross_the_wire_and_files():
    table = plan_servers(RoutingTable.static(["a", "b", "c"]), ["a", "b", "c"], replicas=2)
    assert (table.backups != table.owners).all() and (table.backups != NO_SERVER).all()
    arrays, meta = table.to_wire()
    again = RoutingTable.from_wire(arrays, meta)
    assert again.version == table.version and (again.backups == table.backups).all()
    assert (RoutingTable.from_json(table.to_json()).owners == table.owners).all()
    with pytest.raises(ValueError, match="backups"):
        RoutingTable(1, ("a", "b"), np.zeros(NUM_BUCKETS, np.int32), np.zeros(NUM_BUCKETS, np.int32))
