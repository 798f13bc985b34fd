"""What the candidates that bend the yardstick do at import: torch.matmul (the f_b GEMM of the KDA standard) made to
run its work `times` times. Nothing the gate guards is touched; in the candidate's process the standard launches
more kernels and takes longer than alone."""

import torch

_matmul = torch.matmul


def repeat_matmul(times: int) -> None:
    def repeated(*args, **kwargs):
        for _ in range(times - 1):
            _matmul(*args, **kwargs)
        return _matmul(*args, **kwargs)

    torch.matmul = repeated
