"""The jaxtyping annotations are enforced in the test session, so they cannot lie."""

import pytest
import torch

from frawdllm.model.embeddings import apply_rope


def test_shape_annotations_are_checked_at_run_time():
    x = torch.zeros(1, 2, 4, 8)
    cos = torch.zeros(4, 4)
    apply_rope(x, cos, cos)  # matching shapes pass
    with pytest.raises(Exception, match="(?i)type|shape|dimension"):
        apply_rope(x, torch.zeros(5, 4), torch.zeros(5, 4))  # T=5 does not match T=4
