"""Data: download-free token corpora and a deterministic, mesh-independent loader."""

from functional_pp.data.corpus import DEFAULT_MAX_BYTES, ByteCorpus, Corpus, TokenizerCorpus, load_corpus, stdlib_dir
from functional_pp.data.device_batch import BatchShard, batch_shard
from functional_pp.data.loader import (IGNORE_INDEX, DataLoader, balanced_chunk_indices, shard_batch, shard_sequence,
                                       unshard_sequence)

__all__ = [
    "BatchShard",
    "batch_shard",
    "DEFAULT_MAX_BYTES",
    "IGNORE_INDEX",
    "ByteCorpus",
    "Corpus",
    "DataLoader",
    "TokenizerCorpus",
    "balanced_chunk_indices",
    "load_corpus",
    "shard_batch",
    "shard_sequence",
    "stdlib_dir",
    "unshard_sequence",
]
