import numpy as np
import pytest
import torch

from frugaltrain.config import ConfigError
from frugaltrain.data.corpus import CHUNK, BatchSampler, load_corpus, shard_tokens
from frugaltrain.data.shards import TokenArray


def test_stdlib_corpus_is_real_and_deterministic():
    a = load_corpus("", max_bytes=300_000)
    b = load_corpus("", max_bytes=300_000)
    assert a.num_files > 5
    assert len(a.train) + len(a.val) == 300_000
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert b"def " in bytes(a.train[:200_000].tolist())


def test_split_is_disjoint_by_document(text_dir, tmp_path):
    c = load_corpus(str(text_dir), val_fraction=0.2)
    assert len(c.val) > 0 and len(c.train) > 4 * len(c.val) // 2
    total = sum(p.stat().st_size for p in text_dir.iterdir())
    assert len(c.train) + len(c.val) == total
    # Documents that can be told apart: each one lands whole in exactly one side.
    docs = {f"d{i:02d}.txt": f"<doc {i:02d}> ".encode() * 50 for i in range(30)}
    for name, body in docs.items():
        (tmp_path / name).write_bytes(body)
    c = load_corpus(str(tmp_path), val_fraction=0.2)
    train, val = bytes(c.train.tolist()), bytes(c.val.tolist())
    sides = [(body in train) + 2 * (body in val) for body in docs.values()]
    assert set(sides) == {1, 2}  # each document in train (1) or val (2), never both or split
    assert sides.count(2) >= 2 and len(train) + len(val) == sum(map(len, docs.values()))


def test_shards_partition_the_stream():
    tokens = torch.arange(10 * CHUNK + 123) % 256
    for sharding in ("iid", "noniid"):
        shards = [shard_tokens(tokens, w, 3, 0, sharding) for w in range(3)]
        assert sum(len(s) for s in shards) == len(tokens)
        assert torch.equal(torch.sort(torch.cat(shards)).values, torch.sort(tokens).values)
    # 6 shards over 3 workers: worker 1 reads shards 1 and 4.
    two = shard_tokens(tokens, 1, 3, 6, "noniid")
    assert len(two) == sum(len(shard_tokens(tokens, s, 6, 6, "noniid")) for s in (1, 4))


def test_batches_are_a_function_of_step():
    tokens = torch.arange(5000) % 256
    s = BatchSampler(tokens, seq_len=16, batch_size=3, seed=5)
    x1, y1 = s.batch(7)
    x2, y2 = BatchSampler(tokens, 16, 3, seed=5).batch(7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(s.batch(8)[0], x1)


# ---------------------------------------------------------------- token shards as a corpus


def _token_array(values: np.ndarray, cuts: list[int]) -> TokenArray:
    """values as a TokenArray over several parts (shard files in real use)."""
    return TokenArray(np.split(values, cuts))


def test_token_array_slices_across_parts():
    values = np.arange(1000, dtype=np.uint16)
    a = _token_array(values, [7, 300, 301, 650])
    assert len(a) == 1000
    for lo, hi in [(0, 1000), (5, 9), (299, 302), (300, 301), (640, 1000), (10, 10), (-20, -3)]:
        assert np.array_equal(a[lo:hi], values[lo:hi])
    assert a[-1] == 999 and a[300] == 300
    view = a.view(np.array([[650, 660], [5, 8], [299, 303]]))
    assert np.array_equal(view[0 : len(view)], np.r_[650:660, 5:8, 299:303])
    nested = view.view(np.array([[8, 15]]))  # a view of a view: ranges of ranges
    assert np.array_equal(nested[0:7], np.r_[658:660, 5:8, 299:301])
    assert len(a.view(np.zeros((0, 2), np.int64))) == 0


@pytest.mark.parametrize("sharding", ["iid", "noniid"])
@pytest.mark.parametrize("workers,num_shards", [(3, 0), (2, 6), (4, 4), (5, 7)])
def test_shard_tokens_on_shards_match_the_tensor_path(sharding, workers, num_shards):
    n = 10 * CHUNK + 123
    values = np.arange(n, dtype=np.uint32)  # distinct tokens: coverage and disjointness show
    array = _token_array(values, [CHUNK + 5, 5 * CHUNK, 5 * CHUNK + 1])
    tensor = torch.from_numpy(values.astype(np.int64))
    parts = []
    for w in range(workers):
        lazy = shard_tokens(array, w, workers, num_shards, sharding)
        assert isinstance(lazy, TokenArray)
        eager = shard_tokens(tensor, w, workers, num_shards, sharding)
        assert np.array_equal(lazy[0 : len(lazy)], eager.numpy())  # same tokens, same order
        parts.append(lazy[0 : len(lazy)])
    everything = np.concatenate(parts)
    assert len(everything) == n and np.array_equal(np.sort(everything), values)


def test_noniid_shards_of_a_large_stream_cover_it_exactly():
    n = (1 << 24) + 3  # float32 rounds this up: the tensor path's bounds would pass the end
    array = TokenArray([np.broadcast_to(np.zeros(1, np.uint16), (n,))])  # no memory
    parts = [shard_tokens(array, w, 3, 7, "noniid") for w in range(3)]
    assert sum(len(p) for p in parts) == n and len(parts[2][-5 : len(parts[2])]) == 5


def test_batch_sampler_on_shards_equals_the_tensor_sampler():
    values = (np.arange(20_000) * 7919 % 5000).astype(np.uint16)
    array = _token_array(values, [3000, 11_000])
    a = BatchSampler(array, seq_len=64, batch_size=5, seed=3)
    b = BatchSampler(torch.from_numpy(values.astype(np.int64)), seq_len=64, batch_size=5, seed=3)
    for step in (0, 1, 17):
        (xa, ya), (xb, yb) = a.batch(step), b.batch(step)
        assert xa.dtype == torch.int64 and torch.equal(xa, xb) and torch.equal(ya, yb)
    again = BatchSampler(array, 64, 5, seed=3).batch(17)
    assert torch.equal(again[0], xa) and torch.equal(xa[:, 1:], ya[:, :-1])


def test_batch_sampler_state_dict_round_trip():
    tokens = torch.arange(5000) % 256
    s = BatchSampler(tokens, seq_len=16, batch_size=3, seed=5)
    for step in range(4):
        s.batch(step)
    state = s.state_dict()
    assert state == {"step": 4, "seed": 5, "seq_len": 16, "batch_size": 3, "num_tokens": 5000}
    resumed = BatchSampler(tokens, 16, 3, seed=5)
    resumed.load_state_dict(state)
    assert resumed.step == 4 and torch.equal(resumed.batch(resumed.step)[0], s.batch(4)[0])
    with pytest.raises(ConfigError, match="seed = 5, this run 6"):
        BatchSampler(tokens, 16, 3, seed=6).load_state_dict(state)
    with pytest.raises(ConfigError, match="num_tokens.*data.path"):
        BatchSampler(tokens[:4000], 16, 3, seed=5).load_state_dict(state)


def test_load_corpus_reads_a_shard_directory(shard_dir):
    from frugaltrain.data.shards import open_shards

    c = load_corpus(str(shard_dir), max_bytes=123, val_fraction=0.5)  # both unused for shards
    shards = open_shards(shard_dir)
    assert isinstance(c.train, TokenArray) and len(c.train) == len(shards.train) > 0
    assert len(c.val) == shards.manifest["splits"]["val"]["tokens"]
    assert c.vocab_size == shards.vocab_size == 384
    assert c.tokenizer_dir == shard_dir / "tokenizer" and "token shards" in c.source
    assert np.array_equal(c.train[100:200], shards.train[100:200])
    bytes_corpus = load_corpus("", max_bytes=10_000)
    assert bytes_corpus.vocab_size == 256 and bytes_corpus.tokenizer_dir is None
