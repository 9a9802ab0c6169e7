"""kernels/op_count.py: the checker the kernels' and the decode step's no-sync tests rely on can fail."""

from __future__ import annotations

import pytest
import torch

from kernels.launches import launch
from kernels.op_count import HostSync, OpCounter


def test_host_syncs_and_data_dependent_shapes_raise():
    x = torch.randn(8)
    with pytest.raises(HostSync), OpCounter(strict=True):
        x.sum().item()
    with pytest.raises(HostSync), OpCounter(strict=True):
        torch.nonzero(x > 0)
    with pytest.raises(HostSync), OpCounter(strict=True):
        torch.unique(x)
    with OpCounter() as c:  # not strict: counted, not raised
        float(x.max())
    assert c.syncs == {"aten._local_scalar_dense": 1}


def test_ops_views_and_launches_are_counted_as_kernels():
    x = torch.randn(8)
    with OpCounter(strict=True) as c:
        y = torch.softmax(x, -1).view(2, 4).t()  # one kernel; the views launch nothing
        with launch("my_kernel"):
            y.clone()  # inside a launch: the launch's own (the interpreter's argument copies)
        y.argmax()
    assert c.ops == {"aten._softmax": 1, "aten.argmax": 1} and c.launches == {"my_kernel": 1}
    assert c.total == 3 and not c.syncs
