"""Hardware profiles: the numbers the scheduler and the simulator plan with.

Each field of the H200 profile says where its number comes from: "GPU.md" is the team's record
of measurements on the lent 2x H200 machines (kept outside this repository; the repository's own
GPU measurements are benchmarks/NOTES.md and benchmarks/results/), "vendor sheet" where nothing
was measured. Profiles load from and save to JSON so users can describe their own clusters.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HardwareProfile", "H200"]


class HardwareProfile(BaseModel):
    """One GPU model in one cluster fabric. Bandwidths in GB/s (1e9 B/s), rates in TFLOP/s."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    sms: int = Field(gt=0, description="streaming multiprocessors per GPU")
    tile_gemm_tflops: float = Field(gt=0, description="dense bf16 GEMM rate on all SMs")
    attention_tflops: float = Field(gt=0, description="flash-attention forward rate on all SMs")
    hbm_gbps: float = Field(gt=0, description="device memory bandwidth")
    nvlink_gbps: float = Field(gt=0, description="NVLink per GPU per direction, link rate")
    nvlink_push_gbps: float = Field(gt=0, description="NVLink per direction that SM stores reach")
    nvlink_push_sms: int = Field(gt=0, description="communication SMs that saturate NVLink push")
    rdma_gbps: float = Field(gt=0, description="inter-node bandwidth per GPU (its NIC)")
    rdma_latency_us: float = Field(ge=0, description="one RDMA write, post to remote visibility")
    proxy_command_us: float = Field(ge=0, description="host proxy cost per FIFO command")
    chunk_bytes: int = Field(gt=0, description="smallest network chunk worth a proxy command")
    proxy_batch: int = Field(gt=0, description="most commands the proxy submits at once")
    # -- simulator constants (runtime/sim/); defaults are H200's, so older profile JSON loads --
    grouped_gemm_tflops: float = Field(600.0, gt=0, description="MoE grouped expert GEMM rate")
    launch_us: float = Field(4.0, ge=0, description="one kernel launch, host call to first SM")
    nvlink_latency_us: float = Field(1.0, ge=0, description="a flag store seen by a peer GPU")
    fifo_push_us: float = Field(1.0, ge=0, description="GPU writes one command to host FIFO")
    rdma_chunk_us: float = Field(0.5, ge=0, description="NIC cost per RDMA write (+ flag)")
    nccl_nvlink_gbps: float = Field(259.0, gt=0, description="NCCL bus bandwidth over NVLink")
    nccl_rdma_efficiency: float = Field(
        0.92, gt=0, le=1, description="fraction of NIC bandwidth NCCL reaches"
    )
    nccl_base_us: float = Field(8.4, ge=0, description="NCCL fixed latency per collective")
    nccl_nvlink_step_us: float = Field(3.4, ge=0, description="NCCL latency per NVLink step")
    nccl_net_step_us: float = Field(9.6, ge=0, description="NCCL latency per network step")
    nccl_sms: int = Field(16, ge=0, description="SMs NCCL kernels occupy while they run")
    # -- the megakernel as measured (benchmarks/NOTES.md); the scheduler's partition uses them --
    nvlink_task_gbps: float = Field(
        3.0, gt=0, description="bytes/s one megakernel NVLink worker moves in per-tile tasks"
    )
    nvlink_max_sms: int = Field(
        32, gt=0, description="most SMs the static partition gives NVLink tasks"
    )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        return cls.model_validate_json(Path(path).read_text())

    def sm_share(self, sms: int) -> float:
        """Fraction of the full-chip compute rate that ``sms`` compute SMs deliver."""
        return max(0, min(sms, self.sms)) / self.sms


H200 = HardwareProfile(
    name="H200",
    sms=132,  # GPU.md: 132 SMs each
    tile_gemm_tflops=725.0,  # GPU.md: cuBLAS 8192x8192x4096 bf16 in 0.74-0.77 ms (710-742 TF/s)
    attention_tflops=354.0,  # GPU.md: SDPA FA2 backend B4 H16 S16384 D128 (cuDNN reaches 617)
    hbm_gbps=4800.0,  # vendor sheet: 4.8 TB/s HBM3e
    nvlink_gbps=478.0,  # GPU.md: 18 NVLinks, about 478 GB/s per direction
    nvlink_push_gbps=340.0,  # GPU.md: Triton pointer stores from 132 programs, 340 GB/s
    nvlink_push_sms=16,  # GPU.md: 10-16 programs saturate what SMs can push (278 GB/s at 16)
    rdma_gbps=50.0,  # mKernel's cluster: 400 Gb/s NIC per GPU; GPU.md uses the same cap
    rdma_latency_us=3.0,  # typical InfiniBand RC write latency (not measured here)
    proxy_command_us=5.0,  # a native drain loop must beat 200 k commands/s (GPU.md)
    chunk_bytes=256 * 1024,  # GPU.md: 256 KiB chunks at 50 GB/s need 200 k commands/s
    proxy_batch=8,  # at most 8 commands per proxy submission (DESIGN)
    # Simulator constants. Measured ones come from GPU.md; the rest are marked as estimates.
    grouped_gemm_tflops=600.0,  # GPU.md: MoE T=4096/GPU H=7168 F=2048 top-8: the two grouped
    # GEMMs (3 x 2 x 32768 x 7168 x 2048 = 2.89 TFLOP) take 4.8 ms: 601 TF/s
    launch_us=4.0,  # estimate: CUDA launch overhead is 3-5 us on Hopper (not measured here)
    nvlink_latency_us=1.0,  # estimate: sys-scope release + remote atomic over NVLink, ~1 us
    fifo_push_us=1.0,  # estimate: claim a FIFO slot + 64 B command + release store over PCIe
    rdma_chunk_us=0.5,  # estimate: per-write NIC work (WQE + trailing flag write); NICs reach
    # line rate from ~64 KiB messages, so it is small beside a 256 KiB chunk's 5.2 us
    nccl_nvlink_gbps=259.0,  # GPU.md: NCCL all_reduce 128 MB on 2 GPUs, algbw 259 GB/s (=
    # busbw for 2 ranks)
    nccl_rdma_efficiency=0.92,  # estimate: NCCL over 400 Gb/s IB reaches ~46 of 50 GB/s
    nccl_base_us=8.4,  # NCCL's tuning model (src/graph/tuning.cc): ring/Simple base latency
    nccl_nvlink_step_us=3.4,  # NCCL tuning.cc: ring/Simple latency per step over NVLink
    nccl_net_step_us=9.6,  # NCCL tuning.cc: ring/Simple latency per step over the network
    nccl_sms=16,  # estimate: NCCL runs 16 channels (one CTA = one SM each) on NVLink nodes
    nvlink_task_gbps=3.0,  # bench_tp v3/v4 (2x H200): ~2.5-3 GB/s per NVLink worker at 32
    # workers with per-tile push tasks (sync per 64 KiB tile), far below GPU.md's 17 GB/s bulk push
    nvlink_max_sms=32,  # bench_tp v1-v4: fused GEMM+AR/RS times fall up to 24-32 NVLink workers
)
