"""Hardware profiles: the numbers the scheduler and the simulator plan with.

Each field of the H200 profile says where its number comes from (../shared/GPU.md, measured on a
2x H200 machine, or the vendor sheet where nothing was measured). Profiles load from and save to
JSON so users can describe their own clusters.
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
)
