"""Token shards (docs/data_format.md): the Python writer and reader of dflash's training data.

A shard holds documents; each document is token ids (uint32) plus a loss mask (uint8, 1 on
supervised tokens). The C++ reader is trainer/data/shard.h; both sides write the same bytes.
Files are written to a temporary name and renamed, so a reader never sees half a shard.
"""
from __future__ import annotations

import os
import struct
import zlib
from typing import Iterable, List, Sequence, Tuple

import numpy as np

MAGIC = b"DFLSHARD"
VERSION = 1
HEADER_BYTES = 64
EXTENSION = ".dfshard"
_HEAD = struct.Struct("<8sIIQQQQIII")  # magic .. reserved2 = 60 bytes, then u32 crc32
assert _HEAD.size == 60


def _header(n_docs: int, n_tokens: int, vocab_size: int) -> bytes:
    file_bytes = HEADER_BYTES + 8 * (n_docs + 1) + 5 * n_tokens
    head = _HEAD.pack(MAGIC, VERSION, HEADER_BYTES, n_docs, n_tokens, vocab_size, file_bytes, 4, 0, 0)
    return head + struct.pack("<I", zlib.crc32(head) & 0xFFFFFFFF)


def write_shard(path: str, docs: Sequence[Tuple[Sequence[int], Sequence[int]]], vocab_size: int = 0) -> None:
    """Writes `docs` = [(ids, mask), ...] to `path` (through path + '.tmp' and a rename)."""
    lengths = []
    for i, (ids, mask) in enumerate(docs):
        if len(ids) != len(mask):
            raise ValueError(f"document {i}: {len(ids)} ids but {len(mask)} mask values")
        lengths.append(len(ids))
    offsets = np.zeros(len(docs) + 1, dtype="<u8")
    offsets[1:] = np.cumsum(np.asarray(lengths, dtype=np.uint64)) if lengths else []
    n_tokens = int(offsets[-1])
    ids = np.concatenate([np.asarray(d[0], dtype=np.int64) for d in docs]) if docs else np.zeros(0, np.int64)
    mask = np.concatenate([np.asarray(d[1], dtype=np.int64) for d in docs]) if docs else np.zeros(0, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("token ids must fit in uint32")
    if vocab_size and ids.size and ids.max() >= vocab_size:
        raise ValueError(f"token id {int(ids.max())} is not below vocab_size {vocab_size}")
    if mask.size and not np.isin(mask, (0, 1)).all():
        raise ValueError("loss mask values must be 0 or 1")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(_header(len(docs), n_tokens, vocab_size))
        f.write(offsets.tobytes())
        f.write(ids.astype("<u4").tobytes())
        f.write(mask.astype(np.uint8).tobytes())
    os.replace(tmp, path)


def read_shard(path: str) -> Tuple[List[Tuple[np.ndarray, np.ndarray]], int]:
    """Reads a shard back: ([(ids, mask), ...], vocab_size). Validates like the C++ reader."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER_BYTES:
        raise ValueError(f"{path}: truncated header")
    magic, version, hb, n_docs, n_tokens, vocab, file_bytes, tb, _, _ = _HEAD.unpack_from(data)
    (crc,) = struct.unpack_from("<I", data, 60)
    if magic != MAGIC or version != VERSION or hb != HEADER_BYTES or tb != 4:
        raise ValueError(f"{path}: not a version-{VERSION} dflash shard")
    if crc != zlib.crc32(data[:60]) & 0xFFFFFFFF:
        raise ValueError(f"{path}: header checksum mismatch")
    if file_bytes != len(data):
        raise ValueError(f"{path}: {len(data)} bytes, header says {file_bytes}")
    off = np.frombuffer(data, "<u8", n_docs + 1, HEADER_BYTES)
    tok = np.frombuffer(data, "<u4", n_tokens, HEADER_BYTES + 8 * (n_docs + 1))
    msk = np.frombuffer(data, np.uint8, n_tokens, HEADER_BYTES + 8 * (n_docs + 1) + 4 * n_tokens)
    docs = [(tok[off[i]:off[i + 1]].astype(np.int64), msk[off[i]:off[i + 1]].copy()) for i in range(n_docs)]
    return docs, vocab


class ShardWriter:
    """Streams documents into numbered shard files of about `tokens_per_shard` tokens each:
    <out_dir>/<prefix>-00000.dfshard, ... Call add() per document, then close().

    Memory stays bounded whatever the shard size: each document's ids and mask are appended to
    two scratch files as they come (only the per-document lengths are kept, 8 bytes each), and a
    shard is assembled from them in 4 MiB pieces when it is full (header, offsets, ids, mask;
    written to a temporary name and renamed)."""

    CHUNK = 1 << 22

    def __init__(self, out_dir: str, vocab_size: int, tokens_per_shard: int = 1 << 28, prefix: str = "data"):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.vocab_size, self.limit, self.prefix = out_dir, vocab_size, tokens_per_shard, prefix
        self.lengths: List[int] = []
        self.tokens = 0
        self.paths: List[str] = []
        self.total_docs = 0
        self.total_tokens = 0
        self._ids = self._mask = None

    def _scratch(self):
        if self._ids is None:
            base = os.path.join(self.out_dir, f".{self.prefix}-{len(self.paths):05d}")
            self._ids, self._mask = open(base + ".ids.tmp", "w+b"), open(base + ".mask.tmp", "w+b")

    def add(self, ids: Sequence[int], mask: Sequence[int]) -> None:
        a = np.asarray(ids, dtype=np.int64)
        m = np.asarray(mask, dtype=np.int64)
        if a.shape != m.shape or a.ndim != 1:
            raise ValueError(f"document {self.total_docs}: {a.size} ids but {m.size} mask values")
        if a.size and (a.min() < 0 or a.max() >= 2**32):
            raise ValueError("token ids must fit in uint32")
        if self.vocab_size and a.size and a.max() >= self.vocab_size:
            raise ValueError(f"token id {int(a.max())} is not below vocab_size {self.vocab_size}")
        if m.size and not np.isin(m, (0, 1)).all():
            raise ValueError("loss mask values must be 0 or 1")
        self._scratch()
        self._ids.write(a.astype("<u4").tobytes())
        self._mask.write(m.astype(np.uint8).tobytes())
        self.lengths.append(int(a.size))
        self.tokens += int(a.size)
        self.total_docs += 1
        self.total_tokens += int(a.size)
        if self.tokens >= self.limit:
            self._flush()

    def _flush(self) -> None:
        if not self.lengths:
            return
        path = os.path.join(self.out_dir, f"{self.prefix}-{len(self.paths):05d}{EXTENSION}")
        offsets = np.zeros(len(self.lengths) + 1, dtype="<u8")
        offsets[1:] = np.cumsum(np.asarray(self.lengths, dtype=np.uint64))
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_header(len(self.lengths), int(offsets[-1]), self.vocab_size))
            f.write(offsets.tobytes())
            for scratch in (self._ids, self._mask):
                scratch.flush()
                scratch.seek(0)
                while True:
                    piece = scratch.read(self.CHUNK)
                    if not piece:
                        break
                    f.write(piece)
        os.replace(tmp, path)
        for scratch in (self._ids, self._mask):
            scratch.close()
            os.unlink(scratch.name)
        self._ids = self._mask = None
        self.paths.append(path)
        self.lengths, self.tokens = [], 0

    def close(self) -> List[str]:
        self._flush()
        return self.paths


def iter_documents(paths: Iterable[str]):
    for p in paths:
        docs, _ = read_shard(p)
        yield from docs
