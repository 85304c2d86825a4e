"""A checkpoint's training state (state.pt) is read with torch.load(weights_only=True): a
planted pickle runs nothing and is one clear line, as a truncated file is."""

import pickle

import pytest
import torch

from frawdllm.errors import FrawdError
from frawdllm.train.checkpoint import STATE_FILE, load_state


class Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # would create the marker file when unpickled


@pytest.mark.filterwarnings("error")
def test_a_planted_state_runs_nothing_and_is_one_clear_line(tmp_path):
    marker = tmp_path / "ran"
    with open(tmp_path / STATE_FILE, "wb") as f:
        pickle.dump({"step": 3, "x": Planted(marker)}, f)
    with pytest.raises(FrawdError) as info:
        load_state(tmp_path)
    message = str(info.value)
    assert not marker.exists()
    assert message == (f"{tmp_path / STATE_FILE}: cannot read the training state: it holds objects other than "
                       "tensors and plain values, which are not loaded (a damaged or tampered file)")
    assert "weights_only" not in message and "\n" not in message  # (torch's advice to turn the check off)


def test_a_truncated_state_is_one_clear_line_and_a_good_one_loads(tmp_path):
    torch.save({"step": 3, "t": torch.ones(2)}, tmp_path / STATE_FILE)
    assert load_state(tmp_path)["step"] == 3
    data = (tmp_path / STATE_FILE).read_bytes()
    (tmp_path / STATE_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(FrawdError, match="cannot read the training state") as info:
        load_state(tmp_path)
    assert "\n" not in str(info.value)


def test_pruning_keeps_the_newest_and_the_best(tmp_path):
    from frawdllm.train.checkpoint import CHECKPOINTS_DIR, prune

    root = tmp_path / "run" / CHECKPOINTS_DIR
    for step in (1, 2, 3, 4):
        (root / f"step_{step:08d}" / "model").mkdir(parents=True)
        for name in (STATE_FILE, "model/model.safetensors", "model/config.json"):
            (root / f"step_{step:08d}" / name).write_bytes(b"x")
    prune(tmp_path / "run", keep_last=1, keep_steps={2})  # step 2: the best so far
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
    prune(tmp_path / "run", keep_last=1, keep_steps=set())
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004"]


def test_pruning_a_checkpoint_that_is_a_link_removes_the_link_only(tmp_path):
    """A checkpoint folder linked in from another run: pruning raised "cannot call rmtree on
    a symbolic link" (and had it followed the link, it would have deleted the other run's)."""
    from frawdllm.train.checkpoint import CHECKPOINTS_DIR, prune

    def checkpoint(folder):
        (folder / "model").mkdir(parents=True)
        for name in (STATE_FILE, "model/model.safetensors", "model/config.json"):
            (folder / name).write_bytes(b"x")
        return folder

    elsewhere = checkpoint(tmp_path / "other" / "step_00000002")
    root = tmp_path / "run" / CHECKPOINTS_DIR
    root.mkdir(parents=True)
    (root / "step_00000002").symlink_to(elsewhere, target_is_directory=True)
    for step in (4, 6):
        checkpoint(root / f"step_{step:08d}")
    prune(tmp_path / "run", keep_last=2, keep_steps=set())
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006"]
    assert (elsewhere / STATE_FILE).is_file()  # the linked run's checkpoint untouched
