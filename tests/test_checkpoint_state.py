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


@pytest.mark.parametrize("files_json, present, complete", [
    (None, (STATE_FILE, "model/model.safetensors", "model/config.json"), True),  # before files.json existed
    (None, (STATE_FILE, "model/model.safetensors"), False),  # (its config.json gone)
    ('["state.pt", "model/model.safetensors", "model/config.json", "model/tokenizer.json"]',
     (STATE_FILE, "model/model.safetensors", "model/config.json"), False),  # a listed file gone
    ("[]", ("model/model.safetensors", "model/config.json"), False),  # a damaged list: the three checked
    ('["model/model.safetensors"]', ("model/model.safetensors",), False),  # a list without state.pt: the same
    ("not json", (STATE_FILE, "model/model.safetensors", "model/config.json"), True),
    ('{"state.pt": {"bytes": 1}, "model/model.safetensors": {}}', (STATE_FILE, "model/model.safetensors"), True),
    ('{"state.pt": {}, "model/x": {}}', (STATE_FILE, "model/model.safetensors", "model/config.json"), False),
    ('{"state.pt": {}, "/dev/zero": {}}', (STATE_FILE, "model/model.safetensors", "model/config.json"), True),
    ('["state.pt", "../../elsewhere"]', (STATE_FILE, "model/model.safetensors", "model/config.json"), True),
])
def test_a_checkpoint_is_complete_when_it_holds_what_it_lists_or_the_three_files(tmp_path, files_json, present,
                                                                                  complete):
    """A folder that lacks a file a checkpoint needs is never resumed from (and is named)."""
    from frawdllm.train.checkpoint import CHECKPOINTS_DIR, damaged_checkpoint, list_checkpoints

    folder = tmp_path / CHECKPOINTS_DIR / "step_00000004"
    (folder / "model").mkdir(parents=True)
    for name in present:
        (folder / name).write_bytes(b"x")
    if files_json is not None:
        (folder / "files.json").write_text(files_json)
    assert list_checkpoints(tmp_path) == ([(4, folder)] if complete else [])
    assert (damaged_checkpoint(tmp_path) is None) == complete


def test_the_newest_damaged_checkpoint_is_the_one_named(tmp_path):
    from frawdllm.train.checkpoint import CHECKPOINTS_DIR, damaged_checkpoint

    for step in (2, 4):
        (tmp_path / CHECKPOINTS_DIR / f"step_{step:08d}" / "model").mkdir(parents=True)
    assert damaged_checkpoint(tmp_path) == (f"{tmp_path / CHECKPOINTS_DIR / 'step_00000004'} lacks state.pt and "
                                            "model/model.safetensors and model/config.json")
