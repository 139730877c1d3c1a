"""The on-disk spool: order, bound, and unreadable files."""

from __future__ import annotations

import os

from hindsight.agent import Spool, SpooledBatch


def batch(seq: int, size: int = 100, events: int = 5) -> SpooledBatch:
    return SpooledBatch(seq, bytes([seq % 256]) * size, events, "zstd")


def drain(spool: Spool) -> list[int]:
    out = []
    while (b := spool.peek()) is not None:
        out.append(b.seq)
        spool.remove(b.seq)
    return out


def test_drains_in_sequence_order_across_reopen(tmp_path):
    spool = Spool(str(tmp_path), 1 << 20)
    for seq in (3, 1, 2):
        spool.put(batch(seq))
    reopened = Spool(str(tmp_path), 1 << 20)
    assert len(reopened) == 3
    first = reopened.peek()
    assert first is not None and first.body == batch(1).body and first.encoding == "zstd"
    assert drain(reopened) == [1, 2, 3]


def test_full_spool_drops_oldest_and_counts_events(tmp_path):
    spool = Spool(str(tmp_path), 3 * 150)
    for seq in range(5):
        spool.put(batch(seq))
    assert spool.bytes <= 3 * 150
    assert spool.dropped["spool_full"] == 2 * 5
    assert drain(spool) == [2, 3, 4]


def test_truncated_and_corrupted_files_are_skipped_and_counted(tmp_path):
    spool = Spool(str(tmp_path), 1 << 20)
    for seq in range(4):
        spool.put(batch(seq, events=7))
    names = sorted(os.listdir(tmp_path))
    with open(tmp_path / names[1], "r+b") as f:
        f.truncate(10)
    with open(tmp_path / names[2], "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")
    assert drain(spool) == [0, 3]
    assert spool.dropped["spool_corrupt"] == 14
    assert os.listdir(tmp_path) == []


def test_unusable_directory_falls_back_to_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    spool = Spool(str(blocker / "spool"), 1 << 20)
    assert spool.directory is None
    spool.put(batch(1))
    spool.put(batch(0))
    assert drain(spool) == [0, 1]
