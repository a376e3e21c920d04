"""Suite-wide settings. Tile bodies on the CPU are tiny matmuls: torch's intra-op threads only
contend with the runtime's worker threads on CI's two cores, so the suite runs single-threaded."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
