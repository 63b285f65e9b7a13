"""Entropy coding for OSCAR's ASC (adaptive stepwise coding) on top of ``constriction``."""

from gradsync.coding.asc import (
    ASCRingCoder,
    StaticTableCoder,
    decode_with_counts,
    encode_with_counts,
    measure_ring_coding,
)

__all__ = [
    "ASCRingCoder",
    "StaticTableCoder",
    "decode_with_counts",
    "encode_with_counts",
    "measure_ring_coding",
]
