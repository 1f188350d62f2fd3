"""The routed experts' grouped GEMM in Triton: rows sorted by expert, each tile of rows
belonging to one expert, so each program multiplies its rows by one expert's weight.

* With the batch-invariant mode's fixed tiles (`engine.kernels.batch_invariant.TILES`, the
  default here) a row's result depends on its own values and its expert's weight only, never
  on how many rows the batch holds: the mode's MoE. Outside the mode the same kernel serves
  decode-sized batches, where it beats torch's grouped GEMM (`engine.model.experts`).
* With `TUNED_GROUPED`'s tiles (prefill sizes, outside the mode) a 128-row tile holds a
  typical prefill expert's rows, so each expert's weight streams from memory once.
* `tile_map` places the tiles on the device (no host wait, capturable in a CUDA graph), and
  `shared_tile_map` lets an expert pass's gate/up and down products share one map.
* `engine.kernels.fp8` runs the same kernel with ``SCALED``: FP8 weights with 128 x 128
  block scales, dequantised tile by tile in registers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels.batch_invariant import NUM_STAGES, NUM_WARPS, TILES, check_operands


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GroupedTiles:
    """One configuration of the grouped kernel: tiles of ``bm`` rows x ``bn`` columns, the
    reduction in steps of ``bk``; ``columns_first`` orders the programs column tile fastest, so
    the programs of one row tile run together and its activations stay in L2 while the
    expert's weight streams through once."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    columns_first: bool = False


#: the configuration outside the batch-invariant mode (`engine.model.experts` takes it from
#: decode to prefill sizes): the fastest of 32 configurations `sluice bench moe --sweep` timed
#: on an H200 at flash-shape widths, 96 rows per expert (2026-12-04; docs/benchmarks.md,
#: "Routed experts from decode to prefill sizes"). A 128-row tile holds a typical prefill
#: expert's rows, so each expert's weight is read from memory once.
TUNED_GROUPED = GroupedTiles(128, 256, 64, warps=8, stages=4, columns_first=True)


@functools.cache
def _kernel() -> Any:  # built on first use, so importing this module never needs Triton
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_kernel(
        x_ptr, w_ptr, s_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, row_end_ptr, N, K, E,
        s_xm, s_xk, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_om, s_on,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr,
        COLUMNS_FIRST: tl.constexpr = False,
    ):  # fmt: skip
        # SCALED: w is FP8 with one scale per BLOCK x BLOCK block (s_ptr), each tile scaled and
        # rounded to x's dtype in registers (`engine.kernels.fp8`); BN divides BLOCK, BK is BLOCK.
        # COLUMNS_FIRST: a 1-D grid, column tiles fastest (`GroupedTiles.columns_first`)
        if COLUMNS_FIRST:
            column_tiles = tl.cdiv(N, BN)
            tile = tl.program_id(0) // column_tiles
            pid_n = tl.program_id(0) % column_tiles
        else:
            tile = tl.program_id(0)
            pid_n = tl.program_id(1)
        e = tl.load(tile_expert_ptr + tile)
        if e < E:
            row0 = tl.load(tile_row_ptr + tile)
            row_end = tl.load(row_end_ptr + e)
            rm = row0 + tl.arange(0, BM)
            rn = pid_n * BN + tl.arange(0, BN)
            w_base = w_ptr + e.to(tl.int64) * s_we
            s_base = s_ptr + e.to(tl.int64) * s_se + ((pid_n * BN) // BLOCK) * s_sn
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                rk = (k0 + tl.arange(0, BK)).to(tl.int64)
                a = tl.load(
                    x_ptr + rm[:, None].to(tl.int64) * s_xm + rk[None, :] * s_xk,
                    mask=(rm[:, None] < row_end) & (rk[None, :] < K), other=0.0,
                )  # fmt: skip
                b = tl.load(
                    w_base + rk[:, None] * s_wk + rn[None, :].to(tl.int64) * s_wn,
                    mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0,
                )  # fmt: skip
                if SCALED:  # the dequantised weight's values
                    b = (b.to(tl.float32) * tl.load(s_base + (k0 // BLOCK) * s_sk)).to(a.dtype)
                acc = tl.dot(a, b, acc)
            o = out_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :] * s_on
            tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < row_end) & (rn[None, :] < N))

    return grouped_kernel


def grouped_kernel() -> Any:
    """`grouped_matmul`'s Triton kernel; `engine.kernels.fp8` runs it with ``SCALED``."""
    return _kernel()


def tile_map(row_end: torch.Tensor, rows: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tile's expert and first row (int32) for ``rows`` rows grouped by expert (``row_end``:
    each group's end), tiles of ``bm`` rows that never mix experts. Built on the device, so the
    caller never waits for it (a CUDA graph can capture it); sized for the worst case, rows /
    bm tiles plus one partial tile per expert with rows (at most min(E, rows)); a tile past
    the last has expert E."""
    e = row_end.shape[0]
    ends = row_end.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + bm - 1) // bm  # [E]
    tile_end = torch.cumsum(tiles, 0)
    most = _cdiv(rows, bm) + min(e, rows)
    t = torch.arange(most, device=row_end.device)
    expert = torch.searchsorted(tile_end, t, right=True)  # [most]; E past the last tile
    first = (tile_end - tiles).index_select(0, expert.clamp(max=e - 1))
    row = starts.index_select(0, expert.clamp(max=e - 1)) + (t - first) * bm
    return expert.to(torch.int32), row.to(torch.int32)


#: tile maps already built for one grouping of rows (one ``row_end``), by (tile height, rows):
#: an expert pass's gate/up and down products share one (`shared_tile_map`)
TileMaps = dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


def shared_tile_map(
    row_end: torch.Tensor, rows: int, bm: int, maps: TileMaps | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tile_map`, built once per (``bm``, ``rows``) in ``maps`` when given: ``maps`` belongs to
    one ``row_end`` (its caller's grouping), so the second product over the same rows issues
    none of the map's ~17 small device operations again."""
    if maps is None:
        return tile_map(row_end, rows, bm)
    key = (bm, rows)
    if key not in maps:
        maps[key] = tile_map(row_end, rows, bm)
    return maps[key]


def grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    row_end: torch.Tensor,
    tiles: GroupedTiles | None = None,
    *,
    maps: TileMaps | None = None,
) -> torch.Tensor:
    """Rows ``x`` [R, K] sorted by expert, ``row_end`` [E] (int32, the cumulative row counts as
    ``torch._grouped_mm``'s ``offs``), experts' weights ``w`` [E, N, K] -> [R, N] = x @ w[e].T.

    Tiles never mix experts (`tile_map`; ``maps`` shares it between products over the same
    rows, `shared_tile_map`). ``tiles``: the mode's fixed tiles unless given
    (`TUNED_GROUPED`); only the fixed tiles are batch-invariant."""
    check_operands(x, w)
    r, k = x.shape
    e, n, _ = w.shape
    out = torch.empty((r, n), dtype=x.dtype, device=x.device)
    if r == 0:
        return out
    if tiles is None:
        bm, bn, bk = TILES[x.element_size()]
        tiles = GroupedTiles(bm, bn, bk, NUM_WARPS, NUM_STAGES)
    expert, row = shared_tile_map(row_end, r, tiles.bm, maps)
    columns = _cdiv(n, tiles.bn)
    grid = (expert.shape[0] * columns,) if tiles.columns_first else (expert.shape[0], columns)
    _kernel()[grid](
        x, w, w, out, expert, row, row_end, n, k, e,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), 0, 0, 0, out.stride(0), out.stride(1),
        BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, SCALED=False, BLOCK=1, COLUMNS_FIRST=tiles.columns_first,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip
    return out
