"""Peer buffers for ranks that share one GPU, mapped through CUDA IPC.

torch symmetric memory refuses two ranks on one device ("allocations from overlapping
devices"), so when ranks share a GPU (a one-GPU machine checking a multi-rank graph; NCCL refuses
it too, the group is gloo) each rank allocates its buffer with the caching allocator and opens the
others' with ``cudaIpcOpenMemHandle``, as torch.multiprocessing shares CUDA tensors. The contexts
of the processes time-slice on the GPU, so such runs check correctness, never speed.

``IpcBuffers`` answers the two questions the runtime asks of a symmetric-memory handle:
``buffer_ptrs`` (every rank's address, in rank order) and ``get_buffer(rank, shape, dtype)``."""

from __future__ import annotations

import torch


def ranks_share_a_gpu(device: torch.device) -> bool:
    """Whether any two ranks of the default group run on the same GPU (one collective)."""
    import torch.distributed as dist

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    seen: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, uuid)
    return len(set(seen)) < len(seen)


class IpcBuffers:
    """Every rank's copy of one buffer: this rank's tensor and the peers', opened through IPC."""

    def __init__(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        self.tensor = tensor
        self.rank, world = dist.get_rank(), dist.get_world_size()
        handle = tensor.untyped_storage()._share_cuda_()
        handles: list[tuple | None] = [None] * world
        dist.all_gather_object(handles, handle)
        self._storages: dict[int, torch.UntypedStorage] = {}
        for r, h in enumerate(handles):
            if r != self.rank:
                # the storage's address already includes the block offset the handle carries
                self._storages[r] = torch.UntypedStorage._new_shared_cuda(*h)
        offset = tensor.data_ptr() - tensor.untyped_storage().data_ptr()
        self.buffer_ptrs = [
            tensor.data_ptr() if r == self.rank else self._storages[r].data_ptr() + offset
            for r in range(world)
        ]

    def get_buffer(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s buffer as a tensor of ``shape`` and ``dtype`` (from its first byte)."""
        if rank == self.rank:
            return self.tensor.view(torch.uint8).view(dtype)[: _numel(shape)].view(shape)
        raw = torch.empty(0, dtype=torch.uint8, device=self.tensor.device)
        storage = self._storages[rank]
        offset = self.tensor.data_ptr() - self.tensor.untyped_storage().data_ptr()
        raw.set_(storage, offset, (storage.nbytes() - offset,))
        return raw.view(dtype)[: _numel(shape)].view(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
