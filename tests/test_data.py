import torch

from frugaltrain.data.corpus import CHUNK, BatchSampler, load_corpus, shard_tokens


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
