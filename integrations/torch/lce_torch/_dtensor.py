"""DTensor arguments (torch.distributed.tensor) of the LM-head functions.

PyTorch's own tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` on the
LM head, as torchtitan does) holds the head's weight as a DTensor sharded by rows,
``Shard(0)``: each rank its block of the vocabulary, in ``torch.chunk``'s split (blocks of
``ceil(V / P)`` rows, the last ones shorter or empty). lce's tensor parallelism is the same
thing in other words: a ``group`` and this rank's ``vocab_start``. ``local_head`` turns the
one into the other, so that ``linear_cross_entropy(h, lm_head.weight, y)`` works on such a
weight as it does on a plain one. The local tensors come from ``to_local()``, which is
differentiable: the gradients go back to the DTensors with their placements (the weight's
``Shard(0)``, a replicated hidden's ``Replicate()``, since lce sums the hidden gradient
over the group; a hidden sharded by rows, sequence parallel, gets its rows' gradient).

A DTensor's placements and mesh are the same on every rank (SPMD), so a layout refused
here is refused on every rank alike, before any collective. What only one rank can see
(its local shard's rows, for a DTensor built by hand) is checked among the checks the
group's ranks share (``head_checks.check_shard``), so that every rank raises.

A ``Shard(0)`` weight is also what FSDP's ``fully_shard`` makes of a data-parallel
model's parameters, whose ranks hold different batches. Taken as tensor parallelism, such
a call would mix every rank's tokens into one loss without a word. So the hidden states
that lce takes as replicated are compared across the mesh when the call runs
(``head_checks.agreed_ids``: a fingerprint of their bits, exchanged by
``lce.agree_on_values``; lce's own call compares the targets), and every rank raises
where they differ.
"""

import torch


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return None
    return DTensor


def is_dtensor(x):
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(x, dtensor)


def _vocabulary_block(rows, ranks, rank):
    # torch.chunk's split, which DTensor's Shard uses: blocks of ceil(rows / ranks).
    block = -(-rows // ranks)
    start = min(rank * block, rows)
    return start, min(start + block, rows) - start


def _bit_lanes(x):
    """x's bits as 32-bit integers: float32 as they are, float64 as two halves, bfloat16 and
    float16 joined in pairs along an even last dimension, low half first (int16 where it is
    odd). Sums of 32-bit lanes in int32 ran 5-8x faster than of 16-bit ones or than any
    sum into int64 on the CPU. The same numbers whatever the layout: pairs are read in
    place where the layout allows (outside torch.compile, which cannot read a storage
    offset), else joined by arithmetic."""
    v = x.detach()
    if v.dim() == 0:
        v = v.reshape(1)
    if not v.is_floating_point():
        return v
    size = v.element_size()
    if size != 2:
        return (v if v.stride(-1) == 1 else v.contiguous()).view(torch.int32)
    v = v.view(torch.int16)
    if v.shape[-1] % 2:
        return v
    if not torch.compiler.is_compiling() and v.stride(-1) == 1 and all(
            n % 2 == 0 for n in (v.storage_offset(), *v.stride()[:-1])):
        return v.view(torch.int32)
    return (v[..., 0::2].to(torch.int32) & 0xFFFF) | (v[..., 1::2].to(torch.int32) << 16)


def bits_fingerprint(x):
    """Four int64 numbers, equal on every rank for equal tensors: the sums of x's rows and of
    its columns (its bits as _bit_lanes' integers, each sum modulo 2^32), each in total and
    weighted by position modulo a 31-bit prime. Integer sums are exact in any order, so no
    thread count or kernel choice makes equal tensors differ; any one change shows, as do
    rows or values swapped. A fingerprint, not a comparison of every bit: changes built to
    cancel modulo 2^32 (a sign flipped in every element of a row and a column, each an even
    count) do not show. Two passes over x: at [4096, 4096] 2-6 ms in bfloat16 or float32 on
    two cores of a Xeon."""
    lanes = _bit_lanes(x)
    prime = 2**31 - 1

    def total_and_weighted(sums):
        sums = sums.to(torch.int64)
        position = torch.arange(sums.numel(), device=sums.device).remainder(prime) + 1
        return [sums.sum(), (sums.remainder(prime) * position).remainder(prime).sum()]

    rows = lanes.sum(dim=-1, dtype=torch.int32).flatten()
    columns = (lanes.sum(dim=tuple(range(lanes.dim() - 1)), dtype=torch.int32) if lanes.dim() > 1 else lanes)
    return torch.stack(total_and_weighted(rows) + total_and_weighted(columns))


class HeadChecks:
    """What a call with a DTensor weight checks once its group's ranks have taken its
    arguments: this rank's shard (``check_shard``, among the checks they share) and, for a
    sharded weight, that the hidden states lce takes as replicated are the same on every
    rank (``agreed_ids``, before the op)."""

    def __init__(self, fn="", weight=None, local_rows=0, hidden=None):
        self._fn, self._weight, self._local_rows, self._hidden = fn, weight, local_rows, hidden

    def check_shard(self):  # a DTensor built by hand (from_local) with other blocks
        if self._weight is None:
            return
        local = self._weight.to_local()
        if local.shape[0] != self._local_rows:
            raise ValueError(f"lce_torch.{self._fn}: weight's local shard has {int(local.shape[0])} rows where "
                             f"torch.chunk's split of {int(self._weight.shape[0])} rows over "
                             f"{self._weight.device_mesh.size()} ranks gives {int(self._local_rows)}: pass "
                             f"weight.to_local() with group= and this rank's vocab_start= instead")

    def agreed_ids(self, ids, opts):
        """ids (targets or target sets), once the ranks of opts' group (the weight's mesh) found
        the hidden states they take as replicated equal (they raise together otherwise), with
        a zero added so that a compiled graph keeps the comparison. As they are without a
        DTensor weight, for a replicated one (no group) and under sequence parallelism (each
        rank its own rows). lce's own call compares the ids."""
        if self._weight is None or opts["group_name"] is None or opts["sequence_parallel"]:
            return ids
        zero = torch.ops.lce.agree_on_values(
            bits_fingerprint(self._hidden), opts["group_name"],
            f"{self._fn}'s hidden states beside a Shard(0) DTensor weight (lce runs it as tensor parallelism over "
            f"the weight's mesh, every rank the same tokens; a weight sharded for data parallelism, as FSDP's "
            f"fully_shard holds it, is gathered inside the FSDP module's forward: call lce there)")
        return ids + zero.to(ids.dtype)


NO_DTENSOR = HeadChecks()


def local_head(fn, hidden, weight, bias, group, vocab_start, sequence_parallel):
    """(hidden, weight, bias, group, vocab_start, sequence_parallel, head_checks) as lce takes
    them: the arguments as they are where none of hidden, weight and bias is a DTensor;
    otherwise the local tensors, with the weight's mesh as ``group`` and its shard's first
    row as ``vocab_start``. ``head_checks`` (a HeadChecks) does what only a running call
    can: ``check_shard()`` raises where this rank's shard is not the one ``vocab_start``
    assumes, which only this rank can see (the caller runs it among the checks the group's
    ranks share, so that every rank raises); ``agreed_ids(ids, opts)`` compares the
    replicated hidden states across the ranks."""
    if not (is_dtensor(hidden) or is_dtensor(weight) or is_dtensor(bias)):
        return hidden, weight, bias, group, vocab_start, sequence_parallel, NO_DTENSOR
    if not is_dtensor(weight):
        raise TypeError(f"lce_torch.{fn}: hidden or bias is a DTensor but weight is not: pass the LM head's weight "
                        f"as a DTensor too, or local tensors with group= and vocab_start=")
    if group is not None or not (isinstance(vocab_start, int) and vocab_start == 0):
        raise ValueError(f"lce_torch.{fn}: a DTensor weight carries its group and its shard's first row: pass "
                         f"neither group= nor vocab_start= (got group={group!r}, vocab_start={vocab_start!r})")
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"lce_torch.{fn}: weight's device mesh must be 1-D (the tensor-parallel group), got {mesh.ndim} "
            f"dimensions {tuple(mesh.shape)}: pass weight.to_local() with group= and vocab_start= instead")
    (placement,) = weight.placements
    if mesh.get_coordinate() is None:
        raise ValueError(f"lce_torch.{fn}: this rank is not in weight's device mesh: only the mesh's ranks call lce "
                         f"with it")
    if placement.is_shard() and placement.dim in (0, -weight.dim()):
        rows, ranks = weight.shape[0], mesh.size()
        empty = [r for r in range(ranks) if _vocabulary_block(rows, ranks, r)[1] == 0]
        if empty:
            raise ValueError(f"lce_torch.{fn}: torch.chunk's split of weight's {int(rows)} rows over {ranks} ranks "
                             f"leaves rank {empty[0]} no rows, and lce needs every rank to hold part of the "
                             f"vocabulary: use fewer ranks or pad the vocabulary")
        vocab_start, local_rows = _vocabulary_block(rows, ranks, mesh.get_local_rank())
        group = mesh.get_group()
    elif placement.is_replicate():
        local_rows = weight.shape[0]  # one process's call: nothing to compare
    else:
        raise NotImplementedError(
            f"lce_torch.{fn}: weight's placement must be Shard(0) (each rank a block of the vocabulary) or "
            f"Replicate(), got {placement}")
    local_weight = weight.to_local()
    if is_dtensor(bias):
        if bias.device_mesh != mesh or bias.placements != weight.placements:
            raise ValueError(f"lce_torch.{fn}: bias must be placed as weight ({weight.placements} on its mesh), got "
                             f"{bias.placements}")
        bias = bias.to_local()
    if is_dtensor(hidden):
        if hidden.device_mesh != mesh:
            raise ValueError(f"lce_torch.{fn}: hidden's device mesh must be weight's")
        (rows_placement,) = hidden.placements
        if rows_placement.is_shard() and rows_placement.dim in (0, -hidden.dim()) and hidden.dim() == 2 and \
                group is not None:
            sequence_parallel = True  # each rank its block of the tokens: lce's sequence parallelism
        elif not rows_placement.is_replicate():
            raise NotImplementedError(
                f"lce_torch.{fn}: hidden's placement must be Replicate(), or Shard(0) of a packed [N, H] with a "
                f"sharded weight (sequence parallel), got {rows_placement} of a {hidden.dim()}-D hidden: "
                f"redistribute it, e.g. hidden.redistribute(placements=[Replicate()])")
        hidden = hidden.to_local()
    checks = HeadChecks(fn, weight, local_rows, hidden)
    return hidden, local_weight, bias, group, vocab_start, sequence_parallel, checks


def local_replicated(fn, name, tensor):
    """A replicated DTensor (class weights, targets, ids: every rank needs all of them) as
    its local (whole) tensor; anything else as it is."""
    if not is_dtensor(tensor):
        return tensor
    if not all(p.is_replicate() for p in tensor.placements):
        raise NotImplementedError(f"lce_torch.{fn}: a DTensor {name} must be replicated (every rank needs all of "
                                  f"it), got {tensor.placements}")
    return tensor.to_local()
