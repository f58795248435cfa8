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
group's ranks share (``check_shard``), so that every rank raises.
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


def _no_check():
    pass


def local_head(fn, hidden, weight, bias, group, vocab_start, sequence_parallel):
    """(hidden, weight, bias, group, vocab_start, sequence_parallel, check_shard) as lce takes
    them: the arguments as they are where none of hidden, weight and bias is a DTensor;
    otherwise the local tensors, with the weight's mesh as ``group`` and its shard's first
    row as ``vocab_start``. ``check_shard()`` raises where this rank's shard is not the one
    ``vocab_start`` assumes, which only this rank can see: the caller runs it among the
    checks the group's ranks share, so that every rank raises."""
    if not (is_dtensor(hidden) or is_dtensor(weight) or is_dtensor(bias)):
        return hidden, weight, bias, group, vocab_start, sequence_parallel, _no_check
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
        local_rows = weight.shape[0]
    else:
        raise NotImplementedError(
            f"lce_torch.{fn}: weight's placement must be Shard(0) (each rank a block of the vocabulary) or "
            f"Replicate(), got {placement}")
    local_weight = weight.to_local()

    def check_shard():  # a DTensor built by hand (from_local) with other blocks
        if local_weight.shape[0] != local_rows:
            raise ValueError(f"lce_torch.{fn}: weight's local shard has {int(local_weight.shape[0])} rows where "
                             f"torch.chunk's split of {int(weight.shape[0])} rows over {mesh.size()} ranks gives "
                             f"{int(local_rows)}: pass weight.to_local() with group= and this rank's vocab_start= "
                             f"instead")

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
    return hidden, local_weight, bias, group, vocab_start, sequence_parallel, check_shard


def local_replicated(fn, name, tensor):
    """A replicated DTensor (class weights, targets, ids: every rank needs all of them) as
    its local (whole) tensor; anything else as it is."""
    if not is_dtensor(tensor):
        return tensor
    if not all(p.is_replicate() for p in tensor.placements):
        raise NotImplementedError(f"lce_torch.{fn}: a DTensor {name} must be replicated (every rank needs all of "
                                  f"it), got {tensor.placements}")
    return tensor.to_local()
