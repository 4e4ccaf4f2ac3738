"""The all-to-all of Ulysses attention, differentiable.

torch's `torch.distributed.nn.functional` collectives are deprecated, and on gloo their all-gather returned key/value
gradients wrong by about 3 when the incoming gradient was not contiguous (a transposed attention output's is not).
This one makes every buffer contiguous before it is sent.
"""

import torch
import torch.distributed as dist


def all_to_all(tensor: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """
    Cut `tensor` into `world` pieces along `scatter_dim`, send piece `r` to rank `r`, and concatenate the pieces
    received along `gather_dim`, in rank order. The backward is the same exchange with the dimensions swapped.

    With `world` ranks, a `(batch, heads, length / world, dim)` query sharded by sequence becomes `(batch,
    heads / world, length, dim)` sharded by heads with `scatter_dim=1, gather_dim=2`, and back with `scatter_dim=2,
    gather_dim=1`. `tensor.shape[scatter_dim]` must be a multiple of `world`.
    """
    return _AllToAll.apply(tensor, group, scatter_dim, gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(tensor, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, gradient):
        return _exchange(gradient.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def _exchange(tensor: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return tensor
    # all_to_all_single exchanges equal slices of dimension 0: bring the pieces to the front, one per rank.
    pieces = tensor.unflatten(scatter_dim, (world, tensor.shape[scatter_dim] // world)).movedim(scatter_dim, 0)
    received = torch.empty_like(pieces, memory_format=torch.contiguous_format)
    dist.all_to_all_single(received, pieces.contiguous(), group=group)
    # received[r] is rank r's piece: it goes to position r of `gather_dim` (dimension gather_dim + 1 of `received`
    # while the rank dimension leads).
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)
