"""Packing a chain's blocks into block groups (kvstore.groups.pack_groups)."""

from __future__ import annotations

import pytest

from kvstore.groups import group_objects, pack_groups

KiB, MiB = 1 << 10, 1 << 20


def runs(sizes: list[int], group_bytes: int) -> list[list[int]]:
    return [list(r) for r in pack_groups(sizes, group_bytes)]


def test_quarter_mib_blocks_fill_one_mib_groups_exactly() -> None:
    assert runs([256 * KiB] * 10, MiB) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_a_group_closes_before_the_block_that_would_overflow_it() -> None:
    assert runs([600, 400, 1], 1000) == [[0, 1], [2]]  # 1000 fits exactly
    assert runs([600, 401, 1], 1000) == [[0], [1, 2]]


def test_a_block_larger_than_group_bytes_is_an_object_of_its_own() -> None:
    assert runs([100, 5000, 100, 100], 1000) == [[0], [1], [2, 3]]
    assert runs([MiB, MiB], MiB) == [[0], [1]]


def test_zero_disables_grouping_even_for_empty_blocks() -> None:
    assert runs([0, 0, 10], 0) == [[0], [1], [2]]
    assert runs([], MiB) == []


def test_every_index_once_in_order() -> None:
    sizes = [(i * 7919) % 3000 for i in range(200)]
    got = runs(sizes, 4096)
    assert [i for r in got for i in r] == list(range(200))
    assert all(sum(sizes[i] for i in r) <= 4096 or len(r) == 1 for r in got)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="group_bytes must be >= 0"):
        pack_groups([1], -1)
    with pytest.raises(ValueError, match="negative size"):
        pack_groups([1, -2], 10)


def test_objects_concatenate_a_group_and_record_each_span() -> None:
    todo = [(b"a", b"xx"), (b"b", b"yyy"), (b"c", b"z" * 10)]
    objs = group_objects(todo, 5)
    assert objs == [(b"a", b"xxyyy", [(b"a", 0, 2), (b"b", 2, 3)]), (b"c", b"z" * 10, None)]
    assert group_objects(todo, 0) == [(k, p, None) for k, p in todo]
