"""Telling fake tensors from real ones inside an op's checks.

An op's check runs on real tensors (its implementation) and on fake ones (its fake implementation: torch.compile,
FakeTensorMode, opcheck, meta tensors): `lowbit_op` calls the same function for both. Checks that read tensor
values (host index range checks, the LOWBIT_CHECK_INDICES debug checks) must skip fake tensors, which have none.
"""

from __future__ import annotations

from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor


def is_fake(t) -> bool:
    """Whether t is a tensor without readable values: a FakeTensor or a tensor on the meta device. False for
    anything else (real tensors, None, non-tensors: the checks that follow report those)."""
    return isinstance(t, FakeTensor) or (isinstance(t, Tensor) and t.device.type == "meta")
