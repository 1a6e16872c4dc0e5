"""`one_torch_thread`: one intra-op thread inside the block, the previous count after (also on error)."""

from __future__ import annotations

import pytest
import torch

from elastic._util.threads import one_torch_thread


def test_one_thread_inside_restored_after() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_torch_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"), one_torch_thread():
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
