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


def test_a_long_run_checks_its_first_steps_and_the_session_after_it(tmp_path, shape_checks_for_first_steps):
    """`shape_checks_for_first_steps` (conftest): a step within the first five that passes a
    shape its annotation refuses (one PyTorch broadcasts) fails the run; past them the same
    call goes unchecked; once `fit` returns, checks are on again."""
    import torch.nn.functional as F

    from conftest import SHAPE_CHECKED_STEPS
    from frawdllm.train import Trainer, TrainTask
    from frawdllm.train.config import TrainConfig

    class WrongShapeAtStep(TrainTask):
        def __init__(self, step):
            self.step, self.calls = step, 0

        def next_batch(self):
            return torch.ones(2, 4), torch.zeros(2)

        def loss(self, model, batch):
            self.calls += 1
            if self.calls == self.step:  # tables of 1 position broadcast over T = 4: this computes,
                one = torch.zeros(1, 4)  # but the annotation says (T, half)
                apply_rope(torch.zeros(1, 2, 4, 8), one, one)
            return F.mse_loss(model(batch[0]).squeeze(-1), batch[1]), {}

        def save_model(self, model, directory):
            directory.mkdir(parents=True, exist_ok=True)

    def run(step, out):
        cfg = TrainConfig(out=str(tmp_path / out), device="cpu", dtype="fp32", compile="false", max_steps=8,
                          eval_interval=0, progress=False, sample_tokens=0, warmup_steps=0)
        Trainer(torch.nn.Linear(4, 1), WrongShapeAtStep(step), cfg).fit()

    with pytest.raises(Exception, match="(?i)type|shape|dimension"):
        run(SHAPE_CHECKED_STEPS, "checked")
    run(SHAPE_CHECKED_STEPS + 1, "unchecked")  # (no error: the step was past the checked ones)
    assert shape_checks_for_first_steps[0] == 8
    with pytest.raises(Exception, match="(?i)type|shape|dimension"):
        apply_rope(torch.zeros(1, 2, 4, 8), torch.zeros(1, 4), torch.zeros(1, 4))
