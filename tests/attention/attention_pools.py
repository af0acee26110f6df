"""Helpers for attention tests: block tables scattered over a paged pool."""

from __future__ import annotations

import torch


def shuffled_block_tables(
    lens: list[int], block_size: int, gen: torch.Generator, spare: int
) -> tuple[list[list[int]], int]:
    """Block tables for sequences of ``lens`` tokens drawn from a random permutation of a pool
    with ``spare`` blocks more than they need (so each table is out of order, and a kernel that
    reads a wrong block reads another sequence's or garbage). Returns (tables, num_blocks)."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for nb in need:
        tables.append(perm[at : at + nb])
        at += nb
    return tables, num_blocks
