"""A correct candidate that keeps its recurrent state in the L2 between calls: it sets aside part of the L2 for
persisting accesses (a device-wide limit) and gives the stream it is called on an access policy window over the
state, so the state's lines, marked persisting, survive the benchmarks' flush (normal writes cannot evict them) and
every timed call would start warm, where in a decode step the other layers' traffic passes through between calls.
The screen lists the names for review; the benchmarks release the set-aside before timing and fail the candidate."""

import torch
from cuda.bindings import runtime as cudart

from model.kimi_k3.ops.kda_decode import kda_decode as reference


def _keep_in_l2(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    cudart.cudaDeviceSetLimit(cudart.cudaLimit.cudaLimitPersistingL2CacheSize, nbytes)
    value = cudart.cudaStreamAttrValue()
    window = value.accessPolicyWindow
    window.base_ptr, window.num_bytes, window.hitRatio = t.data_ptr(), nbytes, 1.0
    window.hitProp = cudart.cudaAccessProperty.cudaAccessPropertyPersisting
    window.missProp = cudart.cudaAccessProperty.cudaAccessPropertyStreaming
    cudart.cudaStreamSetAttribute(torch.cuda.current_stream().cuda_stream,
                                  cudart.cudaStreamAttrID.cudaLaunchAttributeAccessPolicyWindow, value)


def kda_decode(proj, conv_state, ssm_state, slots, w):
    if ssm_state.is_cuda and not torch.cuda.is_current_stream_capturing():  # the limit cannot be set in a capture
        _keep_in_l2(ssm_state)
    return reference(proj, conv_state, ssm_state, slots, w)
