"""EmbeddingCollection: pooled outputs equal the stores' rows, backward applies the fused
optimizer (once per row when features share a table), eval reads only, bad batches are refused."""
import numpy as np
import pytest
import torch

from hybridrec.data.batch import JaggedFeatures
from hybridrec.embedding import EmbeddingStore, TableConfig
from hybridrec.embedding import kernels as K
from hybridrec.embedding.collection import EmbeddingCollection
from hybridrec.embedding.cache_hints import CACHE_LINE
from hybridrec.embedding.memory import aligned_empty

SGD = {"name": "sgd", "lr": 1.0}


def _features(names, per_feature_lists):
    """per_feature_lists[f][b] = list of IDs of feature f for sample b."""
    values, offsets = [], [0]
    for lists in per_feature_lists:
        for ids in lists:
            values.extend(ids)
            offsets.append(offsets[-1] + len(ids))
    return JaggedFeatures(list(names), np.array(values, dtype=np.uint64), np.array(offsets, dtype=np.int64))


@pytest.mark.parametrize("pooling, scale", [("sum", lambda n: 1.0), ("mean", lambda n: 1.0 / n),
                                            ("sqrtn", lambda n: 1.0 / np.sqrt(n))])
def test_pooled_output_and_gradient_match_the_store(pooling, scale):
    coll = EmbeddingCollection({"t": TableConfig(dim=3, capacity=50, optimizer=SGD, pooling=pooling)}, {"f": "t"})
    batch = _features(["f"], [[[1, 2, 2], [3], []]])
    reference = EmbeddingStore(dim=3, capacity=50, optimizer=SGD)
    rows = reference.pull(np.array([1, 2, 3], np.uint64))
    out = coll(batch)["f"]
    expected = np.stack([scale(3) * (rows[0] + 2 * rows[1]), rows[2], np.zeros(3)])
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-6, atol=1e-7)
    weights = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    (out * weights).sum().backward()
    s = scale(3)
    after = coll.stores["t"].pull(np.array([1, 2, 3], np.uint64), insert=False)
    np.testing.assert_allclose(after, rows - np.stack([s * weights[0].numpy(), 2 * s * weights[0].numpy(),
                                                       weights[1].numpy()]), rtol=1e-6, atol=1e-6)


def test_features_sharing_a_table_get_one_update_with_summed_gradient():
    coll = EmbeddingCollection({"shared": TableConfig(dim=2, capacity=20, optimizer={"name": "adagrad", "lr": 0.1})},
                               {"a": "shared", "b": "shared"})
    batch = _features(["a", "b"], [[[7], [8]], [[7], [9]]])
    before = EmbeddingStore(dim=2, capacity=20).pull(np.array([7], np.uint64))  # same seed, same start
    out = coll.forward_stacked(batch)
    assert out.shape == (2, 2, 2)
    np.testing.assert_array_equal(out[0, 0].detach(), out[0, 1].detach())
    out.sum().backward()
    store = coll.stores["shared"]
    assert store.step == 1
    e = store.export()
    assert dict(zip(e["keys"].tolist(), e["clocks"].tolist())) == {7: 1, 8: 1, 9: 1}
    # Adagrad with summed gradient 2 per coordinate: w -= 0.1 * 2 / sqrt(4)
    np.testing.assert_allclose(store.pull(np.array([7], np.uint64), insert=False), before - 0.1, atol=1e-7)


def test_eval_mode_reads_only():
    coll = EmbeddingCollection({"f": TableConfig(dim=2, capacity=10)})
    batch = _features(["f"], [[[1], [2]]])
    coll.eval()
    out = coll(batch)["f"]
    assert (out == 0).all() and len(coll.stores["f"]) == 0
    coll.train()
    with torch.no_grad():
        coll(batch)
    assert len(coll.stores["f"]) == 0
    coll(batch)["f"].sum().backward()
    assert len(coll.stores["f"]) == 2 and coll.stores["f"].step == 1


def test_a_small_model_learns_through_the_collection():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    coll = EmbeddingCollection({"f": TableConfig(dim=4, capacity=1000, optimizer={"name": "adagrad", "lr": 0.1})})
    head = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    truth = {k: float(rng.integers(0, 2)) for k in range(50)}
    losses = []
    for _ in range(150):
        ids = rng.integers(0, 50, size=64)
        batch = _features(["f"], [[[int(i)] for i in ids]])
        y = torch.tensor([truth[int(i)] for i in ids]).unsqueeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(coll(batch)["f"]), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])


def test_bad_batches_are_refused_with_the_argument_named():
    coll = EmbeddingCollection({"f": TableConfig(dim=2, capacity=10)})
    good = _features(["f"], [[[1], [2]]])
    with pytest.raises(TypeError, match="dtype must be uint64"):
        coll(JaggedFeatures(["f"], good.values.astype(np.int64), good.offsets))
    with pytest.raises(ValueError, match="must start at 0 and end at len\\(values\\)=2"):
        coll(JaggedFeatures(["f"], good.values, np.array([0, 1, 3], np.int64)))
    with pytest.raises(ValueError, match="negative length"):
        coll(JaggedFeatures(["f"], good.values, np.array([0, 2, 1, 2], np.int64)))
    with pytest.raises(ValueError, match="features.values: must be 1-D"):
        coll(JaggedFeatures(["f"], good.values.reshape(2, 1), good.offsets))
    with pytest.raises(ValueError, match=r"features.offsets must be 1-dimensional, got shape \(3, 1\)"):
        coll(JaggedFeatures(["f"], good.values, good.offsets.reshape(-1, 1)))
    with pytest.raises(TypeError, match="features.offsets must have dtype int64, got int32"):
        coll(JaggedFeatures(["f"], good.values, good.offsets.astype(np.int32)))
    with pytest.raises(TypeError, match="features.offsets must be a numpy.ndarray of int64, got list"):
        coll(JaggedFeatures(["f"], good.values, [0, 1, 2]))
    with pytest.raises(ValueError, match="no feature 'f'"):
        coll(JaggedFeatures(["g"], good.values, good.offsets))
    with pytest.raises(ValueError, match="unknown table 'nope'"):
        EmbeddingCollection({"f": TableConfig(dim=2, capacity=10)}, {"f": "nope"})
    assert len(coll.stores["f"]) == 0


def test_memory_mapped_batches_are_taken_like_arrays(tmp_path):
    """IDs and offsets read with np.memmap (an ndarray subclass) give what plain arrays give."""
    coll = EmbeddingCollection({name: TableConfig(dim=4, capacity=20) for name in ("a", "b")})
    coll.eval()
    batch = _features(["a", "b"], [[[1], [2, 3]], [[4], []]])
    for name in ("a", "b"):
        coll.stores[name].pull(np.array([1, 2, 3, 4], np.uint64))
    mapped = {}
    for field in ("values", "offsets"):
        arr = getattr(batch, field)
        mapped[field] = np.memmap(tmp_path / field, dtype=arr.dtype, mode="w+", shape=arr.shape)
        mapped[field][:] = arr
    expected = coll.forward_stacked(batch).numpy()
    got = coll.forward_stacked(JaggedFeatures(batch.names, mapped["values"], mapped["offsets"])).numpy()
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("admit_probability", [1.0, 0.5])  # 0.5: refused keys (no unique row) among the others
def test_many_tables_in_one_call_match_per_table_stores(admit_probability):
    rng = np.random.default_rng(3)
    names = [f"f{i}" for i in range(5)]
    cfg = dict(dim=4, capacity=500, optimizer={"name": "adagrad", "lr": 0.1}, pooling="mean",
               admit_probability=admit_probability)
    coll = EmbeddingCollection({n: TableConfig(seed=i, **cfg) for i, n in enumerate(names)})
    refs = [EmbeddingStore(seed=i, **cfg) for i in range(len(names))]
    for _ in range(5):
        lists = [[list(rng.integers(0, 40, size=rng.integers(0, 4))) for _ in range(6)] for _ in names]
        batch = _features(names, lists)
        out = coll.forward_stacked(batch)
        upstream = torch.randn(out.shape)
        (out * upstream).sum().backward()
        for t, (store, per_sample) in enumerate(zip(refs, lists)):
            keys = np.array([k for ids in per_sample for k in ids], dtype=np.uint64)
            lens = [len(ids) for ids in per_sample]
            rows = store.pull(keys)
            start = 0
            grads = []
            for b, n in enumerate(lens):
                expect = rows[start:start + n].mean(axis=0) if n else np.zeros(4)
                np.testing.assert_allclose(out[b, t].detach().numpy(), expect, rtol=1e-6, atol=1e-7)
                grads += [upstream[b, t].numpy() / n] * n if n else []
                start += n
            if len(keys):
                store.push(keys, np.array(grads, np.float32))
    for name, store in zip(names, refs):
        keys = store.keys()
        np.testing.assert_allclose(coll.stores[name].pull(keys, insert=False), store.pull(keys, insert=False),
                                   rtol=1e-6, atol=1e-7)


def test_a_negative_length_is_reported_at_its_first_place_and_feature():
    """A long batch (the check runs vectorised, then looks for the place) with two decreasing
    offsets: the error names the first one, its values and its feature."""
    names = ["a", "b", "c"]
    coll = EmbeddingCollection({n: TableConfig(dim=2, capacity=10) for n in names})
    offsets = np.arange(3 * 1000 + 1, dtype=np.int64)
    offsets[1501] = 1499  # sample 501 of feature b has length -1 (and 500 has length 0)
    offsets[2600] = 2598
    values = np.arange(3000, dtype=np.uint64)
    with pytest.raises(ValueError, match=r"offsets\[1501\] = 1499 < offsets\[1500\] = 1500 .*feature 'b'"):
        coll(JaggedFeatures(names, values, offsets))
    assert all(len(s) == 0 for s in coll.stores.values())


def test_nan_gradient_is_refused_and_changes_no_row():
    coll = EmbeddingCollection({"a": TableConfig(dim=2, capacity=10), "b": TableConfig(dim=2, capacity=10)})
    batch = _features(["a", "b"], [[[1], [2]], [[3], [4]]])
    out = coll.forward_stacked(batch)
    before = {n: s.export()["weights"].copy() for n, s in coll.stores.items()}
    upstream = torch.ones(out.shape)
    upstream[1, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        (out * upstream).sum().backward()
    for n, s in coll.stores.items():
        np.testing.assert_array_equal(s.export()["weights"], before[n])
        assert s.step == 0


@pytest.mark.parametrize("dim", [3, 16, 32])  # 16, 32: whole cache lines, written with streaming stores
def test_one_hot_features_pool_to_exactly_their_rows(dim):
    rng = np.random.default_rng(4)
    names = ["a", "b", "c"]
    coll = EmbeddingCollection({n: TableConfig(dim=dim, capacity=100, seed=i, admit_min_frequency=2)
                                for i, n in enumerate(names)})
    refs = [EmbeddingStore(dim=dim, capacity=100, seed=i, admit_min_frequency=2) for i in range(3)]
    for _ in range(4):
        lists = [[[int(k)] for k in rng.integers(0, 30, size=8)] for _ in names]
        out = coll.forward_stacked(_features(names, lists))
        out.sum().backward()
        for t, store in enumerate(refs):
            keys = np.array([ids[0] for ids in lists[t]], dtype=np.uint64)
            found = store.lookup(keys)
            # an ID not yet admitted at its lookup (seen once) reads as zeros and gets no gradient
            expect = np.where(found.rows[:, None] >= 0, store.rows[np.maximum(found.rows, 0), :dim], 0.0)
            np.testing.assert_allclose(out[:, t].detach().numpy(), expect, rtol=1e-6, atol=1e-7)
            ugrad = np.zeros((found.num_unique, dim), np.float32)
            np.add.at(ugrad, found.inverse[found.inverse >= 0], 1.0)
            store.apply(found, ugrad)


def test_streamed_pooling_writes_the_same_rows_as_plain_stores():
    """gather_pool copies one-hot rows of whole lines (dim 16, 32) with non-temporal stores only into
    a line-aligned output; any other layout takes the plain copy, and both give the same values."""
    rng = np.random.default_rng(5)
    rows = aligned_empty((64, 64), np.float32, CACHE_LINE)
    rows[:] = rng.standard_normal(rows.shape).astype(np.float32)
    row_ids = rng.integers(-1, 64, size=40).astype(np.int32)  # -1: a missing row reads as zeros
    offsets = np.arange(41, dtype=np.int64)
    for dim in (16, 32):
        aligned = aligned_empty((40, 3, dim), np.float32, CACHE_LINE)
        shifted = aligned_empty((40 * 3 * dim + 4,), np.float32, CACHE_LINE)[4:].reshape(40, 3, dim)
        assert K._can_stream(rows, aligned) and not K._can_stream(rows, shifted)
        expect = np.where(row_ids[:, None] >= 0, rows[np.maximum(row_ids, 0), :dim], 0.0)
        for out in (aligned, shifted):
            out[:] = np.nan
            K.gather_pool(rows, row_ids, offsets, 0, out, 1)
            np.testing.assert_array_equal(out[:, 1], expect)
            assert np.isnan(out[:, [0, 2]]).all()  # the other columns are untouched


def test_a_batch_past_the_index_room_grows_every_table_inside_the_call():
    """The one-call path checks each table's index room in the kernel and grows the index before
    anything is written; every key of the batch is then found."""
    coll = EmbeddingCollection({name: TableConfig(dim=2, capacity=200_000) for name in ("a", "b")})
    rooms_before = [store.index_room for store in coll.stores.values()]
    spread = np.uint64(0x9E3779B97F4A7C15)  # odd: distinct keys stay distinct, spread over 64 bits
    keys = [(np.arange(30_000, dtype=np.uint64) + np.uint64(t)) * spread for t in (1, 7)]
    assert all(30_000 > room for room in rooms_before)
    batch = _features(["a", "b"], [[[int(k)] for k in table_keys] for table_keys in keys])
    trained = coll.forward_stacked(batch).detach().numpy().copy()
    assert all(store.index_room >= 30_000 for store in coll.stores.values())
    assert [len(store) for store in coll.stores.values()] == [30_000, 30_000]
    coll.eval()
    np.testing.assert_array_equal(coll.forward_stacked(batch).numpy(), trained)


def test_the_epoch_count_restarts_inside_the_one_call_path_with_recency_kept():
    """Stamps are int32: at the epoch limit the kernel asks for a restart before writing, and the
    least recently used rows are still the ones evicted afterwards."""
    coll = EmbeddingCollection({name: TableConfig(dim=2, capacity=8, eviction="lru") for name in ("a", "b")})

    def step(key):
        coll.forward_stacked(_features(["a", "b"], [[[key]], [[key]]])).sum().backward()

    for key in range(1, 9):
        step(key)
    for key in range(8, 1, -1):  # least recent now: 1, then 8, 7, ..., 2
        step(key)
    for store in coll.stores.values():
        store.scalars[K.SC_EPOCH] = K.EPOCH_LIMIT
    for key in (100, 101, 102):
        step(key)
    for store in coll.stores.values():
        assert store.scalars[K.SC_EPOCH] < 10
        assert set(store.keys().tolist()) == {2, 3, 4, 5, 6, 100, 101, 102}


def test_features_are_found_by_name_whatever_their_order_in_the_batch():
    coll = EmbeddingCollection({name: TableConfig(dim=2, capacity=100) for name in ("a", "b", "c")})
    coll.eval()
    ids = {"a": [[1], [2]], "b": [[3], [4, 5]], "c": [[6], []]}
    for name, table_ids in ids.items():  # rows for every key, looked up one table at a time
        coll.stores[name].pull(np.array([k for row in table_ids for k in row], np.uint64))
    expected = coll.forward_stacked(_features(["a", "b", "c"], [ids["a"], ids["b"], ids["c"]])).numpy()
    for order in (["c", "a", "b"], ["b", "c", "a"], ["c", "b", "a"]):
        shuffled = _features(order, [ids[name] for name in order])
        np.testing.assert_array_equal(coll.forward_stacked(shuffled).numpy(), expected)
        np.testing.assert_array_equal(coll.forward_stacked(shuffled, ["c", "a"]).numpy(), expected[:, [2, 0]])


def test_a_replaced_store_serves_the_next_batch_and_bad_replacements_are_refused():
    coll = EmbeddingCollection({name: TableConfig(dim=2, capacity=10) for name in ("a", "b")})
    batch = _features(["a", "b"], [[[1]], [[2]]])
    coll.forward_stacked(batch).sum().backward()  # the one-call path is set up over the first stores
    replacement = EmbeddingStore(dim=2, capacity=10, seed=99)
    expected = replacement.pull(np.array([2], np.uint64))
    coll.replace_store("b", replacement)
    out = coll.forward_stacked(batch)
    out.sum().backward()  # trains through the one-call path with the new store
    np.testing.assert_array_equal(out[0, 1].detach().numpy(), expected[0])
    assert replacement.step == 1 and coll.stores["a"].step == 2
    with pytest.raises(TypeError):
        coll.stores["b"] = EmbeddingStore(dim=2, capacity=10)  # read-only: replace_store is the way
    with pytest.raises(ValueError, match=r"unknown table 'bb'.*'b'"):
        coll.replace_store("bb", EmbeddingStore(dim=2, capacity=10))
    with pytest.raises(ValueError, match=r"table 'a' has dim 2, the new store has dim 3"):
        coll.replace_store("a", EmbeddingStore(dim=3, capacity=10))
    assert coll.stores["b"] is replacement


@pytest.mark.parametrize("train", [True, False])
def test_an_output_still_held_is_never_written_by_a_later_batch(train):
    """The one-call path reuses its output array once nothing refers to it; an output, or a view of
    it, that the caller still holds keeps its values through later batches."""
    coll = EmbeddingCollection({name: TableConfig(dim=16, capacity=100) for name in ("a", "b")})
    coll.train(train)
    first = _features(["a", "b"], [[[1], [2]], [[3], [4]]])
    second = _features(["a", "b"], [[[5], [6]], [[7], [8]]])
    held = coll.forward_stacked(first)
    seen = held.detach().clone()
    column = coll.forward(first)["b"]  # a view into that call's output
    seen_column = column.detach().clone()
    for _ in range(3):
        later = coll.forward_stacked(second)
        assert not np.shares_memory(later.detach().numpy(), held.detach().numpy())
        assert not np.shares_memory(later.detach().numpy(), column.detach().numpy())
        del later
    assert torch.equal(held.detach(), seen) and torch.equal(column.detach(), seen_column)
    del held
    again = coll.forward_stacked(second)
    assert torch.equal(column.detach(), seen_column)
    expected = np.stack([coll.stores[t].pull(np.array(ids, np.uint64), insert=False) for t, ids in
                         (("a", [5, 6]), ("b", [7, 8]))], axis=1)
    np.testing.assert_array_equal(again.detach().numpy(), expected)


def test_the_one_call_path_reuses_either_of_its_last_two_outputs_once_released():
    """Two outputs may be alive at once (the pipelined step pools the next batch while the current
    one trains); a released one is written again instead of fresh memory."""
    coll = EmbeddingCollection({name: TableConfig(dim=16, capacity=100) for name in ("a", "b")})
    batch = _features(["a", "b"], [[[1], [2]], [[3], [4]]])
    first = coll.forward_stacked(batch)
    second = coll.forward_stacked(batch)
    addresses = first.data_ptr(), second.data_ptr()
    assert addresses[0] != addresses[1]
    del first
    third = coll.forward_stacked(batch)
    assert third.data_ptr() == addresses[0]
    del second
    assert coll.forward_stacked(batch).data_ptr() == addresses[1]


def test_the_address_table_keeps_the_stores_arrays_alive_and_views_them_unchanged():
    """The group kernels reach every table's arrays through their addresses; the table must hold
    the arrays, so they stay valid (and are the same memory) after the stores themselves are gone."""
    import gc

    from numba import njit

    from hybridrec.embedding.table_arrays import TableArrays, index_of, meta64_of, rows_of, scalars_of

    @njit
    def read(tables, t):
        return rows_of(tables, t).copy(), meta64_of(tables, t)[:, 0].copy(), index_of(tables, t).shape[0], \
            scalars_of(tables, t)[K.SC_EPOCH]

    stores = [EmbeddingStore(dim=4, capacity=64, seed=s) for s in (1, 2)]
    for s in stores:
        s.pull(np.arange(10, dtype=np.uint64) + np.uint64(1 << 63))
    expected = [(s.rows.copy(), s.r64[:, 0].copy(), s.index.shape[0], s.scalars[K.SC_EPOCH]) for s in stores]
    arrays = TableArrays(stores)
    del stores, s
    gc.collect()
    junk = [np.full(4096, 7.0) for _ in range(256)]  # would take over freed memory
    for t, (rows, keys, slots, epoch) in enumerate(expected):
        got = read(arrays.table, t)
        np.testing.assert_array_equal(got[0], rows)
        np.testing.assert_array_equal(got[1], keys)
        assert got[2:] == (slots, epoch)
    del junk
