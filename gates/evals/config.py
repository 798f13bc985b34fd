"""Each eval's fixed budget: one for CPU CI (the tiny preset in fp32) and one for the GPU (k3 layer shapes
in bf16). A budget holds the sizes (samples, lengths) and the bounds that hold for that setting's dtype."""

from __future__ import annotations

from typing import Generic, TypeVar

import torch
from pydantic import BaseModel, ConfigDict

Budget = TypeVar("Budget", bound=BaseModel)


class EvalConfig(BaseModel, Generic[Budget]):
    model_config = ConfigDict(frozen=True)

    seed: int = 0
    cpu: Budget
    gpu: Budget

    def budget(self, device: torch.device) -> Budget:
        return self.gpu if device.type == "cuda" else self.cpu
