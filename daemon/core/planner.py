"""TransferPlanner: which bytes of a source rank's KV go where in a destination rank's KV.

Pure: layouts and block IDs in, descriptor arrays out. No NIXL, no sockets.

The plan is built in three steps, all vectorised with numpy so that 32 layers x
1024 blocks plans in well under a millisecond:

1. **Pieces.** The prompt's tokens are cut at every source and destination block
   boundary, so each piece lies inside one source block and one destination block.
   With equal block sizes a piece is a whole block (the last block's tail is
   copied too: the destination block belongs to this request alone).
2. **Folding.** Inside a piece, one head's K (or V) is granules x segments (see
   :mod:`kvpush.proto.layout`). Any dimension whose stride equals the current
   contiguous run on *both* sides is folded into the run: AMX tiles become whole
   tiles, heads fold into whole blocks, K and V fold together when adjacent.
3. **Merging.** The remaining dimensions are enumerated in source memory order and
   neighbouring descriptors contiguous on both sides are merged, so contiguous
   block IDs become one descriptor per run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvpush.proto import groups
from kvpush.proto.layout import KVLayout, LayoutError, split_address


class PlanError(ValueError):
    """The transfer cannot be planned; nothing was produced."""


@dataclass(frozen=True)
class Plan:
    """Descriptors for one WRITE: plan addresses ``region << REGION_SHIFT | offset`` on each
    side (:func:`kvpush.proto.layout.split_address`); with one region they are plain offsets."""

    src_off: np.ndarray
    dst_off: np.ndarray
    length: np.ndarray
    layer: np.ndarray | None = None  # per descriptor, its layer (``plan(..., by_layer=True)``)

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True)
class _Dim:
    count: int
    src_stride: int
    dst_stride: int


def head_overlap(src: KVLayout, dst: KVLayout) -> tuple[int, int]:
    """Global KV heads held by both ranks, as (first head, count); count 0 if disjoint."""
    lo = max(src.head_start, dst.head_start)
    hi = min(src.head_start + src.num_heads, dst.head_start + dst.num_heads)
    return lo, max(0, hi - lo)


def check_compatible(
    src: KVLayout, dst: KVLayout, sides: tuple[str, str] = ("on the source", "on the destination")
) -> None:
    """Raise PlanError naming both values when byte copies cannot map src onto dst.

    ``sides`` names the two layouts in the message (the handshake says "there" / "here").
    """
    for name in ("dtype", "head_size", "num_layers", "model_heads", "model", "num_kv", "replicated"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise PlanError(f"incompatible layouts: {name} is {a!r} {sides[0]}, {b!r} {sides[1]}")
    if len(src.kv_groups) != len(dst.kv_groups):
        raise PlanError(f"incompatible layouts: {len(src.kv_groups) or 1} KV cache group(s) {sides[0]}, "
                        f"{len(dst.kv_groups) or 1} {sides[1]}")
    for i, (a, b) in enumerate(zip(src.kv_groups, dst.kv_groups, strict=True)):
        if groups.compat(a) != groups.compat(b):
            raise PlanError(f"incompatible layouts: KV cache group {i} is {a!r} {sides[0]}, {b!r} {sides[1]} "
                            "(a group's kind, block size, window, page or state differs between the engines)")
    for kv, half in ((0, "K"), (1, "V")):
        a, b = src.packing(kv).format_key(), dst.packing(kv).format_key()
        if a != b:
            raise PlanError(
                f"incompatible {half} packing (granule tokens, segments, segment bytes): "
                f"{a} {sides[0]}, {b} {sides[1]}; repacking is not supported"
            )


def _checked(src: KVLayout, dst: KVLayout) -> None:
    """Both layouts valid and compatible, or PlanError."""
    try:
        src.validate()
        dst.validate()
    except LayoutError as exc:
        raise PlanError(f"invalid layout: {exc}") from exc
    check_compatible(src, dst)


def _check_blocks(name: str, blocks: np.ndarray, layout: KVLayout, needed: int) -> np.ndarray:
    if blocks.ndim != 1:
        raise PlanError(f"{name} block IDs must be a flat list")
    if blocks.shape[0] < needed:
        raise PlanError(
            f"{name} has {blocks.shape[0]} blocks, {needed} needed for the token range "
            f"at block size {layout.block_size}"
        )
    used = blocks[:needed]
    if needed and (used.min() < 0 or used.max() >= layout.num_blocks):
        bad = used[(used < 0) | (used >= layout.num_blocks)][0]
        raise PlanError(f"{name} block ID {int(bad)} out of range [0, {layout.num_blocks})")
    if np.unique(used).shape[0] != needed:
        raise PlanError(f"{name} block IDs repeat")
    return used


def _as_ids(blocks: object) -> np.ndarray:
    try:
        arr = np.asarray(blocks, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise PlanError(f"block IDs must be integers: {exc}") from exc
    return arr.reshape(-1) if arr.ndim == 0 else arr


def _pieces(
    src: KVLayout, dst: KVLayout, first: int, end: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut tokens [first, end) at both sides' block boundaries.

    Returns per piece: source block index, token offset in it, destination block
    index (relative to the first destination block), token offset in it, tokens.
    """
    sbs, dbs = src.block_size, dst.block_size
    if sbs == dbs and first % sbs == 0:
        n = -(-(end - first) // sbs)
        idx = np.arange(n, dtype=np.int64)
        zeros = np.zeros(n, dtype=np.int64)
        return idx + first // sbs, zeros, idx, zeros.copy(), np.full(n, sbs, dtype=np.int64)
    cuts = np.union1d(
        np.arange(first - first % sbs + sbs, end, sbs, dtype=np.int64),
        np.arange(first + dbs, end, dbs, dtype=np.int64),
    )
    starts = np.concatenate(([first], cuts)).astype(np.int64)
    stops = np.concatenate((cuts, [end])).astype(np.int64)
    return (
        starts // sbs,
        starts % sbs,
        (starts - first) // dbs,
        (starts - first) % dbs,
        stops - starts,
    )


def _fold(atom: int, dims: list[_Dim]) -> tuple[int, list[_Dim]]:
    """Fold every dimension contiguous with the run on both sides into the run."""
    dims = [d for d in dims if d.count > 1]
    changed = True
    while changed:
        changed = False
        for d in dims:
            if d.src_stride == atom and d.dst_stride == atom:
                atom *= d.count
                dims.remove(d)
                changed = True
                break
    return atom, dims


def _enumerate(
    bases: list[tuple[np.ndarray, ...]], dims: list[_Dim]
) -> list[np.ndarray]:
    """Sum offsets (and run lengths, and layer labels) of every axis, outermost (largest
    source stride) first.

    Each axis is (order key, source offsets, destination offsets, length contributions[, layer
    labels]); every axis of one call has the same number of sums.
    """
    axes = list(bases)
    width = len(axes[0]) - 1
    for d in dims:
        idx = np.arange(d.count, dtype=np.int64)
        zero = np.zeros_like(idx)
        axes.append((d.src_stride, idx * d.src_stride, idx * d.dst_stride, *([zero] * (width - 2))))
    axes.sort(key=lambda a: -a[0])
    sums = [np.zeros(1, dtype=np.int64) for _ in range(width)]
    for axis in axes:
        sums = [(acc[:, None] + a[None, :]).reshape(-1) for acc, a in zip(sums, axis[1:], strict=True)]
    return sums


def _merge_pieces(
    ps: np.ndarray, pd: np.ndarray, atom: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive pieces whose runs touch on both sides (contiguous block IDs)."""
    brk = np.ones(ps.shape[0], dtype=bool)
    brk[1:] = (np.diff(ps) != atom) | (np.diff(pd) != atom)
    starts = np.flatnonzero(brk)
    counts = np.diff(np.append(starts, ps.shape[0]))
    return ps[starts], pd[starts], counts * atom


def _merge(s: np.ndarray, d: np.ndarray, ln: np.ndarray, layer: np.ndarray | None = None) -> Plan:
    """Merge runs contiguous on both sides (never across layers when they are labelled)."""
    if s.shape[0] == 0:
        return Plan(s, d, ln, layer)
    brk = np.ones(s.shape[0], dtype=bool)
    ends_s = s[:-1] + ln[:-1]
    ends_d = d[:-1] + ln[:-1]
    brk[1:] = (s[1:] != ends_s) | (d[1:] != ends_d)
    if layer is not None:
        brk[1:] |= layer[1:] != layer[:-1]
    starts = np.flatnonzero(brk)
    return Plan(s[starts], d[starts], np.add.reduceat(ln, starts), None if layer is None else layer[starts])


def plan(
    src: KVLayout,
    src_blocks: object,
    dst: KVLayout,
    dst_blocks: object,
    num_tokens: int,
    *,
    dst_first_token: int = 0,
    layers: tuple[int, int] | None = None,
    by_layer: bool = False,
) -> Plan:
    """Plan copying tokens [dst_first_token, num_tokens) of the heads both ranks hold.

    ``src_blocks`` cover the prompt from token 0; ``dst_blocks`` cover it from
    ``dst_first_token`` (a multiple of the destination block size: tokens before it
    were a prefix-cache hit on the decode side). ``layers``: only layers [lo, hi) (a layer
    group of a stream); ``by_layer``: no descriptor spans two layers, and ``Plan.layer`` says
    each one's (the daemon's prepared lists are then sliced by layer). Raises PlanError before
    producing anything if the input is inconsistent.
    """
    _checked(src, dst)
    if num_tokens <= 0:
        raise PlanError(f"num_tokens must be positive, got {num_tokens}")
    if dst_first_token < 0 or dst_first_token % dst.block_size or dst_first_token >= num_tokens:
        raise PlanError(
            f"dst_first_token {dst_first_token} must be a multiple of the destination block "
            f"size {dst.block_size} below num_tokens {num_tokens}"
        )
    granule = max(src.k_packing.granule_tokens, src.v_packing.granule_tokens)
    end = -(-num_tokens // granule) * granule
    if dst_first_token % granule:
        raise PlanError(f"dst_first_token {dst_first_token} not a multiple of granule {granule}")
    sb = _check_blocks("source", _as_ids(src_blocks), src, -(-num_tokens // src.block_size))
    db = _check_blocks(
        "destination", _as_ids(dst_blocks), dst, -(-(num_tokens - dst_first_token) // dst.block_size)
    )
    head0, nheads = head_overlap(src, dst)
    if nheads == 0:
        raise PlanError(
            f"source heads [{src.head_start}, {src.head_start + src.num_heads}) and destination "
            f"heads [{dst.head_start}, {dst.head_start + dst.num_heads}) do not overlap"
        )

    s_bi, s_tok, d_bi, d_tok, ntok = _pieces(src, dst, dst_first_token, end)
    lo, hi = (0, src.num_layers) if layers is None else layers
    if not 0 <= lo < hi <= src.num_layers:
        raise PlanError(f"layers [{lo}, {hi}) outside [0, {src.num_layers})")
    s_layer = src.virtual_offsets()[lo:hi]
    d_layer = dst.virtual_offsets()[lo:hi]
    labels = np.arange(lo, hi, dtype=np.int64)
    head_src = (head0 - src.head_start) * src.head_stride
    head_dst = (head0 - dst.head_start) * dst.head_stride
    whole_blocks = bool(np.all(s_tok == 0) & np.all(d_tok == 0) & np.all(ntok == src.block_size))
    same_kv = src.k_packing == src.v_packing and dst.k_packing == dst.v_packing

    out: list[list[np.ndarray]] = []
    for n in np.unique(ntok):
        sel = ntok == n
        structures = []
        for kv in range(src.num_kv):
            sp, dp = src.packing(kv), dst.packing(kv)
            dims = [
                _Dim(int(n) // sp.granule_tokens, sp.granule_stride, dp.granule_stride),
                _Dim(sp.segments_per_granule, sp.seg_stride, dp.seg_stride),
                _Dim(nheads, src.head_stride, dst.head_stride),
            ]
            atom, rest = _fold(sp.seg_bytes, dims)
            piece_src = sb[s_bi[sel]] * src.block_stride + (s_tok[sel] // sp.granule_tokens) * sp.granule_stride
            piece_dst = db[d_bi[sel]] * dst.block_stride + (d_tok[sel] // dp.granule_tokens) * dp.granule_stride
            structures.append((atom, rest, piece_src, piece_dst))
        k_atom, k_rest, k_ps, k_pd = structures[0]
        v_atom, v_rest, _, _ = structures[-1]
        if src.num_kv == 1:  # MLA: one latent, nothing to pair
            groups = [(k_atom, k_rest, k_ps, k_pd, 0, 0)]
        elif (whole_blocks or same_kv) and k_atom == v_atom and k_rest == v_rest:
            atom, rest = _fold(k_atom, [*k_rest, _Dim(2, src.kv_stride, dst.kv_stride)])
            groups = [(atom, rest, k_ps, k_pd, 0, 0)]
        else:
            groups = [
                (a, r, ps, pd, kv * src.kv_stride, kv * dst.kv_stride)
                for kv, (a, r, ps, pd) in enumerate(structures)
            ]
        for atom, rest, ps, pd, kv_s, kv_d in groups:
            if atom == src.block_stride == dst.block_stride:
                # Whole block slabs: contiguous block IDs merge before enumeration.
                ps, pd, plen = _merge_pieces(ps, pd, atom)
            else:
                plen = np.full(ps.shape[0], atom, dtype=np.int64)
            zeros = np.zeros(hi - lo, dtype=np.int64)
            layer_axis = (1 << 62, s_layer + kv_s + head_src, d_layer + kv_d + head_dst, zeros)
            block_axis = (src.block_stride, ps, pd, plen)
            if by_layer:
                layer_axis, block_axis = (*layer_axis, labels), (*block_axis, np.zeros_like(ps))
            out.append(_enumerate([layer_axis, block_axis], rest))

    cols = [np.concatenate(c) for c in zip(*out, strict=True)]
    result = _merge(*cols)
    check_bounds(result, src.regions, dst.regions)
    return result


def plan_state(src: KVLayout, src_block: int, dst: KVLayout, dst_block: int, nbytes: int) -> Plan:
    """Plan copying the first ``nbytes`` of one block's page in every layer (a state group's
    running-state slot: vLLM packs the state's sub-tensors from the page's first byte, and pads
    the rest of the page, which never moves).

    A layer's page of block ``b`` starts at its base plus ``b`` block strides (the address of
    its K, first head, first token) and holds the block's ``block_bytes / num_layers`` bytes;
    ``nbytes`` (from the engine's own group description) must fit in that page and in one
    block stride on both sides, which hold every KV head (a state page is never split by
    heads). Raises PlanError before producing anything."""
    _checked(src, dst)
    for name, lay in (("source", src), ("destination", dst)):
        page = lay.block_bytes // lay.num_layers
        if not 0 < nbytes <= min(page, lay.block_stride):
            raise PlanError(f"a state of {nbytes} bytes does not fit the {name}'s page of {page} bytes "
                            f"(block stride {lay.block_stride})")
        if (lay.num_kv > 1 and lay.kv_stride >= lay.block_stride) or (
                lay.num_heads > 1 and lay.head_stride >= lay.block_stride):
            raise PlanError(f"the {name}'s block is not one page (K/V stride {lay.kv_stride}, head stride "
                            f"{lay.head_stride}, block stride {lay.block_stride}): a state does not start it")
        if lay.head_start or lay.num_heads != lay.model_heads:
            raise PlanError(f"a state page moves whole: the {name} holds KV heads [{lay.head_start}, "
                            f"{lay.head_start + lay.num_heads}) of {lay.model_heads}")
    (sb,) = _check_blocks("source", _as_ids([src_block]), src, 1)
    (db,) = _check_blocks("destination", _as_ids([dst_block]), dst, 1)
    s_off = src.virtual_offsets() + sb * src.block_stride
    d_off = dst.virtual_offsets() + db * dst.block_stride
    result = Plan(s_off, d_off, np.full(src.num_layers, nbytes, dtype=np.int64),
                  np.arange(src.num_layers, dtype=np.int64))
    check_bounds(result, src.regions, dst.regions)
    return result


def addresses(plan_addr: np.ndarray, bases: tuple[int, ...] | list[int]) -> np.ndarray:
    """Absolute addresses of plan addresses, given each region's base in one process."""
    region, local = split_address(plan_addr)
    if len(bases) == 1:  # the common CPU case: no gather
        return local + np.int64(bases[0])
    return np.asarray(bases, dtype=np.int64)[region] + local


def check_bounds(p: Plan, src_sizes: tuple[int, ...], dst_sizes: tuple[int, ...]) -> None:
    """Last line of defence: no descriptor may leave its region."""
    if len(p) == 0:
        return
    if p.src_off.min() < 0 or p.dst_off.min() < 0:
        raise PlanError("plan produced a negative offset")
    for off, sizes in ((p.src_off, src_sizes), (p.dst_off, dst_sizes)):
        region, local = split_address(off)
        if region.max() >= len(sizes):
            raise PlanError("plan produced a descriptor in an unknown region")
        if np.any(local + p.length > np.asarray(sizes, dtype=np.int64)[region]):
            raise PlanError("plan produced a descriptor outside a registered region")


def expected_producers(dst: KVLayout, src_tp_size: int, src_heads_per_rank: int) -> list[int]:
    """Source ranks whose heads overlap ``dst``'s heads (each sends one notification).

    With P TP > D TP several producers write into one destination; with P TP < D TP
    one producer writes head slices to several destinations.
    """
    ranks = []
    for r in range(src_tp_size):
        lo, hi = r * src_heads_per_rank, (r + 1) * src_heads_per_rank
        if max(lo, dst.head_start) < min(hi, dst.head_start + dst.num_heads):
            ranks.append(r)
    return ranks


def producer_fanout(dst: KVLayout, dst_tp_size: int, src_tp_size: int,
                    dst_rank: int = 0) -> list[tuple[int, int]]:
    """For a destination rank: each source rank that writes into it, with the number of
    destination ranks that source writes to (its ``expected_dests``: one notification each).

    A replicated layout (MLA: every rank holds the same latent) has one producer per
    destination, ``dst_rank % src_tp_size``, so the latent is written once, not once per
    prefill rank. Raises PlanError when the model's KV heads do not split over ``src_tp_size``.
    """
    if dst.replicated:
        if src_tp_size <= 0 or not 0 <= dst_rank < dst_tp_size:
            raise PlanError(f"rank {dst_rank} of TP {dst_tp_size} from prefill TP {src_tp_size}")
        src = dst_rank % src_tp_size
        return [(src, sum(1 for d in range(dst_tp_size) if d % src_tp_size == src))]
    total = dst.model_heads
    if src_tp_size <= 0 or (total % src_tp_size and src_tp_size <= total):
        raise PlanError(f"{total} KV heads do not split over prefill TP {src_tp_size}")
    src_heads = max(1, total // src_tp_size)
    dst_heads = dst.num_heads
    out = []
    for r in expected_producers(dst, src_tp_size, src_heads):
        lo, hi = r * src_heads, (r + 1) * src_heads
        dests = sum(1 for d in range(dst_tp_size) if max(lo, d * dst_heads) < min(hi, (d + 1) * dst_heads))
        out.append((r, dests))
    return out


@dataclass(frozen=True)
class BlockPattern:
    """What one source block sends to one destination block, the same for every block pair.

    With equal block sizes every plan is the pattern repeated per (source block, destination
    block) pair, shifted by the two block strides. That lets the daemon prepare NIXL
    descriptor lists once per (region, peer), with one descriptor per (pattern entry, block)
    on each side, and post each transfer as two index lists instead of building fresh
    descriptors (NIXL merges the contiguous ones itself).
    """

    src_off: np.ndarray  # per entry, offset in block 0 of the source region
    dst_off: np.ndarray
    length: np.ndarray
    src_stride: int
    dst_stride: int
    src_blocks: int  # blocks per side: the prepared lists hold entries x blocks descriptors
    dst_blocks: int
    layer: np.ndarray  # per entry, its layer: a layer group's WRITE takes the entries of its layers

    @property
    def entries(self) -> int:
        return int(self.length.shape[0])

    def src_list(self) -> np.ndarray:
        """(entries * src_blocks, 2) offsets and lengths, entry-major: index j*src_blocks + b."""
        return _expand(self.src_off, self.length, self.src_stride, self.src_blocks)

    def dst_list(self) -> np.ndarray:
        return _expand(self.dst_off, self.length, self.dst_stride, self.dst_blocks)

    def indices(self, src_blocks: np.ndarray, dst_blocks: np.ndarray,
                keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Index lists into src_list()/dst_list() copying src_blocks[i] onto dst_blocks[i];
        ``keep`` (entries x pairs, bool): only those cells (a layer group, or what the groups
        did not write)."""
        j = np.arange(self.entries, dtype=np.int64)[:, None]
        li = j * self.src_blocks + src_blocks[None, :]
        ri = j * self.dst_blocks + dst_blocks[None, :]
        if keep is None:
            return li.reshape(-1), ri.reshape(-1)
        return li[keep], ri[keep]

    def of_layers(self, lo: int, hi: int) -> np.ndarray:
        """Entries (bool, per entry) of layers [lo, hi)."""
        return (self.layer >= lo) & (self.layer < hi)

    def group_indices(self, parts: Iterable[tuple[int, int, int, tuple[int, ...]]], dst_first_block: int,
                      dst_block_ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, int]:
        """A group WRITE from the prepared lists, with no descriptor built: the index lists
        (local, remote) and the bytes of every entry of each part's layers, ``(layer_lo,
        layer_hi, first_block, src_block_ids)``, over the block pairs the destination holds
        (a decode prefix hit, or blocks past its registration, are not written). Empty lists:
        nothing of it is the destination's."""
        lis, ris, nbytes = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], 0
        for lo, hi, first, src in parts:
            sb, db, _ = part_pairs(first, src, dst_first_block, dst_block_ids)
            if not sb.shape[0]:
                continue
            self.check_range(sb, db)
            rows = self.of_layers(lo, hi)
            j = np.flatnonzero(rows).astype(np.int64)[:, None]
            lis.append((j * self.src_blocks + sb[None, :]).reshape(-1))
            ris.append((j * self.dst_blocks + db[None, :]).reshape(-1))
            nbytes += int(self.length[rows].sum()) * int(sb.shape[0])
        return np.concatenate(lis), np.concatenate(ris), nbytes

    def block_pairs(self, src: KVLayout, src_blocks: object, dst_blocks: object, num_tokens: int,
                    dst_first_token: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The (source, destination) block pairs a transfer copies, checked as plan() checks."""
        if num_tokens <= 0 or dst_first_token < 0 or dst_first_token % src.block_size or dst_first_token >= num_tokens:
            raise PlanError(f"bad token range [{dst_first_token}, {num_tokens}) for block size {src.block_size}")
        n = -(-(num_tokens - dst_first_token) // src.block_size)
        first = dst_first_token // src.block_size
        sb = _as_ids(src_blocks)
        db = _as_ids(dst_blocks)
        if sb.shape[0] < first + n or db.shape[0] < n:
            raise PlanError(f"{sb.shape[0]} source / {db.shape[0]} destination blocks cannot hold {num_tokens} tokens")
        sb, db = sb[first:first + n], db[:n]
        self.check_range(sb, db)
        return sb, db

    def check_range(self, sb: np.ndarray, db: np.ndarray) -> None:
        """Raise PlanError unless every block ID has a row in the prepared lists."""
        if sb.min() < 0 or sb.max() >= self.src_blocks or db.min() < 0 or db.max() >= self.dst_blocks:
            raise PlanError("block ID out of range")


def _expand(off: np.ndarray, length: np.ndarray, stride: int, blocks: int) -> np.ndarray:
    b = np.arange(blocks, dtype=np.int64)[None, :] * stride
    return np.stack(((off[:, None] + b).reshape(-1), np.repeat(length, blocks)), axis=1)


def block_pattern(src: KVLayout, dst: KVLayout, max_descriptors: int = 1 << 20) -> BlockPattern | None:
    """The per-block-pair pattern of src -> dst, or None when plans are not block-periodic
    (different block sizes) or the prepared lists would exceed ``max_descriptors`` a side."""
    if src.block_size != dst.block_size or src.num_blocks < 2 or dst.num_blocks < 2:
        return None
    try:  # by layer: a layer group's WRITE is a slice of the prepared lists
        p00 = plan(src, [0], dst, [0], src.block_size, by_layer=True)
        p10 = plan(src, [1], dst, [0], src.block_size, by_layer=True)
        p01 = plan(src, [0], dst, [1], src.block_size, by_layer=True)
    except PlanError:
        return None
    # Periodic in each side's block ID independently, or not a pattern at all.
    for p, ds, dd in ((p10, src.block_stride, 0), (p01, 0, dst.block_stride)):
        if (len(p) != len(p00) or not np.array_equal(p.length, p00.length)
                or not np.array_equal(p.src_off, p00.src_off + ds) or not np.array_equal(p.dst_off, p00.dst_off + dd)):
            return None
    if len(p00) * max(src.num_blocks, dst.num_blocks) > max_descriptors:
        return None
    assert p00.layer is not None
    return BlockPattern(p00.src_off, p00.dst_off, p00.length, src.block_stride, dst.block_stride,
                        src.num_blocks, dst.num_blocks, p00.layer)


def part_pairs(first_block: int, src_block_ids: tuple[int, ...], dst_first_block: int,
               dst_block_ids: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A streamed part's (source, destination) block pairs, with each pair's position among
    the destination's blocks: request block ``first_block + i`` goes to the destination's
    block ``first_block + i - dst_first_block`` (blocks the destination does not hold, a decode
    prefix hit or beyond its registration, are not written)."""
    src = _as_ids(src_block_ids)
    pos = np.arange(first_block, first_block + src.shape[0], dtype=np.int64) - dst_first_block
    ok = (pos >= 0) & (pos < len(dst_block_ids))
    pos = pos[ok]
    return src[ok], _as_ids(dst_block_ids)[pos] if pos.shape[0] else pos, pos


def unwritten(pattern: BlockPattern, pairs: int, dst_first_block: int,
              parts: Iterable[tuple[int, int, int, int, int]], block_size: int, num_tokens: int) -> np.ndarray:
    """The cells (pattern entry x block pair) of a final WRITE over ``pairs`` destination
    blocks that the stream's group WRITEs did not write for sure.

    ``parts``: (layer_lo, layer_hi, first_block, blocks, end_token) of the groups that landed,
    from the very source blocks the final WRITE reads (``num_tokens``: the seal's). A part whose
    chunk ends inside a block, before the prompt's end, has that block written again: the next
    chunk completes it, and two WRITEs of it (each reading the block when it is sent) are not
    ordered against each other, so only the final WRITE, posted after every group landed,
    holds its whole content for sure (a chunk that ends on a block boundary or at the prompt's
    end read its last block whole; an unknown end, 0, counts as inside). At least one cell
    stays: the notification needs a WRITE to ride on."""
    covered = np.zeros((pattern.entries, pairs), dtype=bool)
    again = np.zeros_like(covered)
    for lo, hi, first, n, end in parts:
        rows = pattern.of_layers(lo, hi)
        a, b = max(0, first - dst_first_block), min(pairs, first + n - dst_first_block)
        last = first + n - 1 - dst_first_block
        if a < b:
            covered[np.ix_(rows, np.arange(a, b))] = True
        if 0 <= last < pairs and (end <= 0 or (end % block_size and end < num_tokens)):
            again[rows, last] = True
    keep = ~covered | again
    if not keep.any():
        keep[-1, -1] = True
    return keep
