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
