"""The loop's seam for tasks other than pretraining: named metrics beside the loss, and
frozen modules (a DPO reference) that the loop moves to the device but never trains."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from frawdllm.errors import FrawdError
from frawdllm.train import Trainer, TrainTask
from frawdllm.train.checkpoint import latest_checkpoint
from frawdllm.train.config import TrainConfig
from frawdllm.train.rundir import metric_panels, plot_losses, read_metrics, task_metric_names

from timing_helpers import FakeTime


class RegressionTask(TrainTask):
    """y = x w; the loss is the MSE; metrics: the batch's mean target and a frozen module's output."""

    bar_metrics = ("target/mean",)

    def __init__(self, batch_size=4, frozen=False):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(16, 4, generator=gen)
        self.y = self.x @ torch.tensor([1.0, -2.0, 3.0, 0.5])
        self.batch_size, self.position, self.seen = batch_size, 0, []
        self.reference = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Dropout(0.5)) if frozen else None

    def next_batch(self):
        rows = slice(self.position, self.position + self.batch_size)
        self.position = (self.position + self.batch_size) % len(self.x)
        return self.x[rows], self.y[rows]

    def loss(self, model, batch):
        x, y = batch
        self.seen.append(float(y.mean()))
        metrics = {"target/mean": y.mean()}
        prediction = model(x).squeeze(-1)
        if self.reference is not None:
            reference = self.reference(x).squeeze(-1)  # eval mode: dropout is off, so no randomness
            metrics["reference/gap"] = (prediction - reference).pow(2).mean()
        return F.mse_loss(prediction, y), metrics

    def frozen_modules(self):
        return {"reference": self.reference} if self.reference is not None else {}

    def save_model(self, model, directory):
        directory.mkdir(parents=True, exist_ok=True)
        save_file(model.state_dict(), str(directory / "model.safetensors"))
        (directory / "config.json").write_text("{}")


def config(tmp_path, **overrides):
    values = dict(out=str(tmp_path / "run"), device="cpu", dtype="fp32", compile="false", lr=0.05,
                  warmup_steps=0, max_steps=4, eval_interval=2, log_interval=1, progress=False, sample_tokens=0)
    values.update(overrides)
    return TrainConfig(**values)


def test_named_metrics_are_averaged_over_micro_batches_and_logged(tmp_path):
    task = RegressionTask(batch_size=4)
    Trainer(torch.nn.Linear(4, 1), task, config(tmp_path, grad_accum=2)).fit()
    train = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for step, record in enumerate(train):
        by_hand = (task.seen[2 * step] + task.seen[2 * step + 1]) / 2  # the step's two micro-batches
        assert record["target/mean"] == pytest.approx(by_hand, abs=1e-6)
    assert task_metric_names(read_metrics(tmp_path / "run")) == ["target/mean"]
    from PIL import Image  # matplotlib's dependency

    # loss.png gains a second panel (taller) when the task logs metrics
    assert Image.open(tmp_path / "run" / "loss.png").height > 450


def test_metrics_of_other_scales_get_their_own_panels(tmp_path):
    # DPO logs rewards (about 1) and log-probabilities (tens of nats): one axis would flatten the rewards
    names = ["rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected", "kl"]
    assert metric_panels(names) == [("rewards", ["rewards/chosen", "rewards/margins"]),
                                    ("logps", ["logps/chosen", "logps/rejected"]), ("task metrics", ["kl"])]
    import json

    from PIL import Image

    heights = []
    for n, keys in enumerate((["rewards/chosen"], names)):
        run = tmp_path / f"run{n}"
        run.mkdir()
        rows = [{"step": s, "loss": 1.0 / s, **{k: -40.0 if k.startswith("logps") else 0.5 for k in keys}}
                for s in (1, 2, 3)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        plot_losses(run)
        heights.append(Image.open(run / "loss.png").height)
    assert heights[1] >= heights[0] + 500  # three metric panels against one


def test_named_metrics_appear_on_the_progress_bar(tmp_path, capsys):
    Trainer(torch.nn.Linear(4, 1), RegressionTask(), config(tmp_path, progress=True)).fit()
    assert "target/mean" in capsys.readouterr().err


def test_frozen_modules_are_moved_kept_in_eval_mode_and_never_trained(tmp_path):
    torch.manual_seed(0)
    task = RegressionTask(frozen=True)
    before = {k: v.clone() for k, v in task.reference.state_dict().items()}
    trainer = Trainer(torch.nn.Linear(4, 1), task, config(tmp_path))
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in optimized for p in task.reference.parameters())
    trainer.fit()
    assert not task.reference.training and not any(p.requires_grad for p in task.reference.parameters())
    assert all(torch.equal(before[k], v) for k, v in task.reference.state_dict().items())
    # the metric it feeds is logged; the checkpoint holds the trained model only
    assert all("reference/gap" in r for r in read_metrics(tmp_path / "run") if "loss" in r)
    saved = load_file(str(latest_checkpoint(tmp_path / "run") / "model" / "model.safetensors"))
    assert set(saved) == {"weight", "bias"}


def test_a_frozen_module_sharing_the_models_parameters_is_refused(tmp_path):
    model = torch.nn.Linear(4, 1)

    class Sharing(RegressionTask):
        def frozen_modules(self):
            return {"reference": model}

    with pytest.raises(ValueError, match="shares parameters"):
        Trainer(model, Sharing(), config(tmp_path))


class FiniteTask(RegressionTask):
    """`batches` batches, then StopIteration (the most natural custom dataset: an iterator)."""

    def __init__(self, batches):
        super().__init__()
        self.left = batches

    def next_batch(self):
        if self.left == 0:
            raise StopIteration
        self.left -= 1
        return super().next_batch()


def test_a_finite_dataset_ends_the_run_with_a_final_evaluation_and_checkpoint(tmp_path):
    """StopIteration from next_batch escaped fit(): no final checkpoint, the steps since the
    last one lost. The step it cuts short (1 of 2 micro-batches here) is dropped."""
    model = torch.nn.Linear(4, 1)
    result = Trainer(model, FiniteTask(batches=7), config(tmp_path, grad_accum=2, max_steps=100,
                                                          eval_interval=100)).fit()
    assert result.stop_reason == "data_exhausted" and result.steps == 3
    assert result.summary().startswith("data_exhausted: 3 steps")
    saved = load_file(str(latest_checkpoint(tmp_path / "run") / "model" / "model.safetensors"))
    assert torch.equal(saved["weight"], model.weight.detach())
    assert all(p.grad is None for p in model.parameters())  # the cut step's gradients dropped
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3]


def test_a_dataset_with_no_batch_is_one_error(tmp_path):
    from frawdllm import FrawdError

    with pytest.raises(FrawdError, match=r"^the task's next_batch gave no batch \(StopIteration before the first step\)$"):
        Trainer(torch.nn.Linear(4, 1), FiniteTask(batches=0), config(tmp_path)).fit()


class MisusedTask(RegressionTask):
    def __init__(self, mistake):
        super().__init__()
        self.mistake = mistake

    def loss(self, model, batch):
        loss, metrics = super().loss(model, batch)
        return {"float metric": (loss, {"m": 1.5}), "vector metric": (loss, {"m": batch[1]}),
                "1-tuple": (loss,), "vector loss": batch[1] - model(batch[0]).squeeze(-1),
                "no gradient": loss.detach(), "list metrics": (loss, [loss])}.get(self.mistake, (loss, metrics))

    def evaluate(self, model, device):
        return {"val_loss": torch.tensor(0.5)} if self.mistake == "tensor val_loss" else \
            {"val_loss": "low"} if self.mistake == "text val_loss" else {}


@pytest.mark.parametrize("mistake, message", [
    ("float metric", "the task's metric 'm' must be a scalar tensor, got float"),
    ("vector metric", "the task's metric 'm' must be a scalar tensor, got a 1-D tensor"),
    ("1-tuple", r"the task's loss must return a scalar tensor or \(loss, \{name: scalar tensor\}\), got tuple"),
    ("vector loss", r"the task's loss must return a scalar tensor or \(loss, \{name: scalar tensor\}\), got a 1-D tensor"),
    ("no gradient", r"the task's loss has no gradient \(not computed from the model's trainable parameters, "
                    r"or under no_grad\)"),
    ("list metrics", "the task's metrics must be a dict of scalar tensors, got list"),
    ("text val_loss", "the task's evaluate result 'val_loss' must be a number, got str"),
])
def test_a_task_returning_the_wrong_kind_of_value_is_told_what_it_must_be(tmp_path, mistake, message):
    """These failed inside the loop's own code: `'float' object has no attribute 'detach'`,
    "only one element tensors can be converted", "not enough values to unpack", a JSON error."""
    with pytest.raises(TypeError, match=f"^{message}$"):
        Trainer(torch.nn.Linear(4, 1), MisusedTask(mistake), config(tmp_path)).fit()


def test_a_scalar_tensor_from_evaluate_is_logged_as_its_number(tmp_path):
    result = Trainer(torch.nn.Linear(4, 1), MisusedTask("tensor val_loss"), config(tmp_path)).fit()
    assert result.val_loss == 0.5
    assert [r["val_loss"] for r in read_metrics(tmp_path / "run") if "val_loss" in r] == [0.5, 0.5, 0.5]


class SlowEvaluationTask(RegressionTask):
    """Steps of 5 ms, evaluations of 1 s, on a fake clock (the loop reads it, the task moves
    it: the step counts below do not depend on the machine's load)."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def loss(self, model, batch):
        self.clock.now += 0.005
        return super().loss(model, batch)

    def evaluate(self, model, device):
        self.clock.now += 1.0
        return {"val_loss": 1.0}


@pytest.fixture
def clock(monkeypatch):
    from frawdllm.train import loop

    fake = FakeTime()
    monkeypatch.setattr(loop, "time", fake)
    return fake


def test_a_time_budget_decays_to_the_floor_by_the_last_step(tmp_path, clock):
    """Progress was elapsed / budget, but training stops early by the final evaluation's
    reserve: a short run's cosine ended far above its floor (about half the peak here)."""
    cfg = config(tmp_path, max_steps=None, max_time="5s", eval_interval=0, lr=1.0, min_lr_ratio=0.0,
                 schedule="cosine", log_interval=1)
    result = Trainer(torch.nn.Linear(4, 1), SlowEvaluationTask(clock), cfg).fit()
    assert result.stop_reason == "max_time"
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if "lr" in r]
    assert len(lrs) > 50 and lrs[-1] < 0.1  # (1.0 at the peak; before, ~0.3 here)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # a cosine never rises (a reserve re-estimated each step moved it)


class LoadArrivesTask(SlowEvaluationTask):
    """Steps twice as slow from the third on (load arriving mid-run)."""

    calls = 0

    def loss(self, model, batch):
        self.calls += 1
        if self.calls > 2:
            self.clock.now += 0.005
        return super().loss(model, batch)


def test_a_time_budget_whose_steps_slow_down_still_decays_to_the_floor(tmp_path, clock):
    """The schedule's reserve was fixed at its first estimate while the stop rule's grew with
    the slower steps: training stopped with the rate at 0.4-0.5 of its peak (floor 0)."""
    cfg = config(tmp_path, max_steps=None, max_time="5s", eval_interval=0, lr=1.0, min_lr_ratio=0.0,
                 schedule="cosine", log_interval=1)
    result = Trainer(torch.nn.Linear(4, 1), LoadArrivesTask(clock), cfg).fit()
    assert result.stop_reason == "max_time"
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if "lr" in r]
    assert len(lrs) > 20 and lrs[-1] < 0.1, (len(lrs), lrs[-1])
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # (the reserve only grows: the rate never rises)


def test_a_task_mistake_on_a_compiled_first_step_is_not_taken_for_a_compile_failure(tmp_path, monkeypatch):
    """The check ran inside the first compiled step's retry: "torch.compile failed (TypeError:
    the task's loss has no gradient); training without it", and the machine's compile cache
    then said compile fails here (later `auto` runs never compiled)."""
    import warnings

    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path / "cache"))
    with warnings.catch_warnings(record=True) as seen, pytest.raises(TypeError, match="has no gradient"):
        warnings.simplefilter("always")
        Trainer(torch.nn.Linear(4, 1), MisusedTask("no gradient"), config(tmp_path, compile="true")).fit()
    assert not [w for w in seen if "torch.compile failed" in str(w.message)]
    assert "failed" not in "".join(p.read_text() for p in (tmp_path / "cache").rglob("*.json"))


class OwnFilesTask(RegressionTask):
    """Saves its model its own way (docs/training.md's save_model / load_model hooks)."""

    def save_model(self, model, directory):
        directory.mkdir(parents=True, exist_ok=True)
        save_file(model.state_dict(), str(directory / "weights.safetensors"))

    def load_model(self, model, directory):
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(directory / "weights.safetensors")))


def test_a_task_saving_its_own_files_gets_pruned_checkpoints_and_resumes(tmp_path):
    """Completeness was a model directory's two files: such a task's checkpoints were never
    pruned, and --resume called its newest "damaged" ("lacks model/model.safetensors")."""
    from frawdllm.train.checkpoint import list_checkpoints

    cfg = dict(eval_interval=2, keep_last=2)
    Trainer(torch.nn.Linear(4, 1), OwnFilesTask(), config(tmp_path, max_steps=10, **cfg)).fit()
    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [8, 10]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000008", "step_00000010"]
    result = Trainer(torch.nn.Linear(4, 1), OwnFilesTask(), config(tmp_path, max_steps=12, resume=True, **cfg)).fit()
    assert result.steps == 12
    for weights in (tmp_path / "run" / "checkpoints").glob("step_*/model/weights.safetensors"):
        weights.unlink()  # (the files it wrote are what a complete checkpoint has)
    with pytest.raises(FrawdError, match=r"step_00000012 lacks model/weights\.safetensors"):
        Trainer(torch.nn.Linear(4, 1), OwnFilesTask(), config(tmp_path, max_steps=14, resume=True, **cfg)).fit()
