"""cadence.tune: lr_find's sweep, suggestion, plot and stops; batch_size_find's search with a simulated out-of-memory
error; and the promise of both, that a fit() after them is bitwise the fit() without them."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import cadence
from cadence.errors import CadenceWarning
from cadence.testing import FakeEngine
from cadence.tune import _captures_cuda_rng, batch_size_find, is_out_of_memory, lr_find, search_batch_size, suggest
from tests.helpers import assert_bitwise_equal, assert_same_state, parameters

PNG = b"\x89PNG\r\n\x1a\n"


class MLPStep(cadence.TrainingStep):
    """A small regression MLP with dropout (so training draws from torch's RNG), Adam and a step scheduler."""

    def __init__(self, seed: int = 0, lr: float = 0.01, dropout: float = 0.1) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 1))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)
        self.batch_sizes: list[int] = []

    def training_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        self.batch_sizes.append(len(inputs))
        return nn.functional.mse_loss(self.model(inputs), targets)


def regression(seed: int = 0, samples: int = 512) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 8, generator=generator)
    targets = inputs @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


def shuffled(seed: int = 0, samples: int = 512, batch_size: int = 32) -> DataLoader[Any]:
    return DataLoader(regression(seed, samples), batch_size=batch_size, shuffle=True)


class SGDStep(MLPStep):
    def __init__(self, seed: int) -> None:
        super().__init__(seed, dropout=0.0)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scheduler = None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_suggestion_falls_in_the_known_good_range(seed: int, capsys: pytest.CaptureFixture[str]) -> None:
    # Trained by hand for two epochs at a fixed rate, this problem ends near its noise floor from 0.01 to 0.1
    # (0.03 and 0.1 best) and blows up from 0.3: the steepest fall of the sweep must lie in the good stretch.
    torch.manual_seed(seed)
    result = lr_find(FakeEngine(), SGDStep(seed), shuffled(seed), min_lr=1e-5, max_lr=10.0, num_steps=100, plot=False)
    assert result.suggestion is not None and 0.01 <= result.suggestion <= 0.2
    assert result.lrs[0] == pytest.approx(1e-5)
    ratios = [later / earlier for earlier, later in zip(result.lrs, result.lrs[1:], strict=False)]
    assert ratios == pytest.approx([10 ** (6 / 99)] * len(ratios))  # exponential, 1e-5 to 10 in 100 steps
    assert len(result.losses) == len(result.lrs) < 100
    assert result.stop_reason is not None and "exceeded 4x the lowest" in result.stop_reason
    assert result.plot is None
    assert f"lr_find: suggested learning rate {result.suggestion:.3g}" in capsys.readouterr().out


def fitted(lr_find_first: bool, fit_before: bool) -> tuple[FakeEngine, MLPStep]:
    engine = FakeEngine(seed=0)
    step = MLPStep()
    loader = shuffled(samples=96)
    if fit_before:
        engine.fit(step, loader, max_epochs=1)
    if lr_find_first:
        lr_find(engine, step, shuffled(seed=5, samples=96), num_steps=20, plot=False)
    engine.fit(step, loader, max_epochs=3 if fit_before else 2)
    return engine, step


@pytest.mark.parametrize("fit_before", [False, True], ids=["fresh step", "after a first fit"])
def test_a_fit_after_lr_find_is_bitwise_the_fit_without_it(fit_before: bool) -> None:
    with_finder, step = fitted(lr_find_first=True, fit_before=fit_before)
    without, reference = fitted(lr_find_first=False, fit_before=fit_before)
    assert_bitwise_equal(parameters(step.model), parameters(reference.model))
    assert_same_state(with_finder.state.counters(), without.state.counters())
    assert step.scheduler.state_dict() == reference.scheduler.state_dict()
    found, expected = step.optimizer.state_dict(), reference.optimizer.state_dict()
    assert found["param_groups"] == expected["param_groups"]
    for key, state in expected["state"].items():
        assert_same_state(found["state"][key], state)


def test_lr_find_puts_back_grads_modes_learning_rates_and_rngs() -> None:
    step = MLPStep(lr=0.02)
    step.model.eval()
    step.model[0].train()
    step.model(torch.ones(2, 8)).sum().backward()
    grads = [parameter.grad.clone() for parameter in step.model.parameters()]  # type: ignore[union-attr]
    modes = [module.training for module in step.model.modules()]
    weights = parameters(step.model)
    torch.manual_seed(7)
    result = lr_find(FakeEngine(), step, shuffled(samples=64), num_steps=12, plot=False)
    after_rng = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after_rng, torch.rand(4))
    assert len(result.lrs) == 12  # 2 batches of data, cycled: every step ran
    assert step.batch_sizes == [32] * 12
    assert_bitwise_equal(parameters(step.model), weights)
    assert_bitwise_equal([parameter.grad for parameter in step.model.parameters()], grads)  # type: ignore[misc]
    assert [module.training for module in step.model.modules()] == modes
    assert [group["lr"] for group in step.optimizer.param_groups] == [0.02]
    assert step.optimizer.state_dict()["state"] == {}


def test_the_plot_is_a_new_png_and_never_replaces_a_file(tmp_path: Path) -> None:
    mine = tmp_path / "lr_find.png"
    mine.write_bytes(b"my own picture")
    engine = FakeEngine(project_dir=tmp_path)
    first = lr_find(engine, SGDStep(0), shuffled(), min_lr=1e-5, max_lr=10.0, num_steps=40)
    second = lr_find(engine, SGDStep(0), shuffled(), min_lr=1e-5, max_lr=10.0, num_steps=40)
    assert first.plot == tmp_path / "lr_find-1.png" and second.plot == tmp_path / "lr_find-2.png"
    assert mine.read_bytes() == b"my own picture"
    assert first.plot.read_bytes().startswith(PNG) and second.plot.read_bytes().startswith(PNG)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lr_find-1.png", "lr_find-2.png", "lr_find.png"]
    assert first.plot.stat().st_mode == mine.stat().st_mode  # an ordinary new file, not a temporary's owner-only one


@pytest.mark.parametrize("rank", [0, 1])
def test_both_finders_refuse_several_processes_before_training(rank: int, tmp_path: Path) -> None:
    # Out of memory is per rank and the divergence stop reads one rank's loss: the ranks would part ways.
    engine = FakeEngine(rank=rank, world_size=2, project_dir=tmp_path)
    step = FailsAbove(limit=10**6)
    weights = parameters(step.model)
    with pytest.raises(RuntimeError, match=r"lr_find\(\) runs in one process, but this engine has 2.*without torchrun"):
        lr_find(engine, step, shuffled(), num_steps=20)
    with pytest.raises(RuntimeError, match=r"batch_size_find\(\) runs in one process.*before launching"):
        batch_size_find(engine, step, regression(samples=50))
    assert step.batch_sizes == [] and not list(tmp_path.iterdir())
    assert_bitwise_equal(parameters(step.model), weights)


def test_a_plot_that_cannot_be_written_warns_and_the_sweep_is_returned(tmp_path: Path) -> None:
    (tmp_path / "runs").write_bytes(b"not a directory")  # what stands where the plot should go
    engine = FakeEngine(project_dir=tmp_path / "runs")
    with pytest.warns(CadenceWarning, match=r"lr_find could not write its plot into .*runs \(FileExistsError") as seen:
        result = lr_find(engine, SGDStep(0), shuffled(), num_steps=20)
    assert seen[0].filename == __file__
    assert result.plot is None and len(result.lrs) == 20 and result.suggestion is not None
    assert (tmp_path / "runs").read_bytes() == b"not a directory"


def test_a_read_only_project_dir_leaves_no_file_behind(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    engine = FakeEngine(project_dir=tmp_path / "runs")
    (tmp_path / "runs").chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(tmp_path / "runs", os.W_OK):
            pytest.skip("this user writes into read-only directories (root)")
        with pytest.warns(CadenceWarning, match=r"lr_find could not write its plot.*PermissionError"):
            result = lr_find(engine, SGDStep(0), shuffled(), num_steps=20)
        assert result.plot is None and len(result.lrs) == 20
        assert not list((tmp_path / "runs").iterdir())
    finally:
        (tmp_path / "runs").chmod(stat.S_IRWXU)


def test_without_matplotlib_there_is_no_plot_and_lr_find_says_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without cadence[plot] looks like
    result = lr_find(FakeEngine(project_dir=tmp_path), SGDStep(0), shuffled(), num_steps=20)
    assert result.plot is None and not list(tmp_path.iterdir())
    assert 'no plot: pip install "cadence[plot]" for one.' in capsys.readouterr().out


class NaNAfter(SGDStep):
    def __init__(self, calls: int) -> None:
        super().__init__(0)
        self.calls = calls

    def training_step(self, batch: Any) -> torch.Tensor:
        self.calls -= 1
        loss = super().training_step(batch)
        return loss * float("nan") if self.calls < 0 else loss


def test_a_non_finite_loss_stops_the_sweep() -> None:
    result = lr_find(FakeEngine(), NaNAfter(calls=15), shuffled(), num_steps=50, plot=False)
    assert len(result.lrs) == 15
    assert result.stop_reason == f"the loss became nan at lr {result.lrs[-1] * (1e8) ** (1 / 49):.3g}"


def test_suggest_needs_five_points_after_the_trimming() -> None:
    assert suggest([1.0, 2.0, 3.0, 4.0, 5.0], [5.0, 4.0, 3.0, 2.0, 1.0]) is None
    assert suggest([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [9.0, 8.0, 7.0, 2.0, 1.0, 0.5]) == 3.0


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"min_lr": 1.0, "max_lr": 0.1}, ValueError, r"min_lr must be below max_lr.*Swap them"),
        ({"min_lr": 0.0}, ValueError, r"lr_find\(min_lr=...\) needs a positive finite number; got 0.0"),
        ({"max_lr": float("inf")}, ValueError, r"lr_find\(max_lr=...\) needs a positive finite number"),
        ({"num_steps": 1}, ValueError, r"lr_find\(num_steps=...\) needs an integer >= 2; got 1"),
        ({"num_steps": 2.0}, ValueError, r"lr_find\(num_steps=...\) needs an integer >= 2; got 2.0"),
    ],
)
def test_bad_lr_find_arguments_are_refused_before_training(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    step = MLPStep()
    weights = parameters(step.model)
    with pytest.raises(error, match=message):
        lr_find(FakeEngine(), step, shuffled(), **arguments)
    assert_bitwise_equal(parameters(step.model), weights)


def test_lr_find_refuses_a_prepared_dataloader_an_empty_one_and_a_non_step() -> None:
    engine = FakeEngine()
    with pytest.raises(TypeError, match=r"engine.prepare\(\) returned.*Pass the plain DataLoader"):
        lr_find(engine, MLPStep(), engine.prepare(shuffled()))
    with pytest.raises(ValueError, match=r"lr_find\(\) got data that yields no batch"):
        lr_find(engine, MLPStep(), DataLoader(regression(samples=0)))
    with pytest.raises(TypeError, match=r"lr_find\(\) takes a cadence.TrainingStep; got Sequential"):
        lr_find(engine, MLPStep().model, shuffled())  # type: ignore[arg-type]


def out_of_memory_above(limit: int) -> Any:
    def trial(size: int) -> None:
        if size > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} MiB.")

    return trial


def test_the_search_doubles_then_bisects_to_the_largest_size_that_runs() -> None:
    result = search_batch_size(out_of_memory_above(37))
    assert result.size == 37
    assert [size for size, _ in result.trials] == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert [size for size, ran in result.trials if not ran] == [64, 48, 40, 38]


def test_a_start_that_fails_searches_below_start() -> None:
    result = search_batch_size(out_of_memory_above(5), start=8)
    assert result.size == 5
    assert result.trials == [(8, False), (4, True), (6, False), (5, True)]


def test_a_start_too_large_bisects_down_and_max_size_caps_the_growth() -> None:
    assert search_batch_size(out_of_memory_above(37), start=100).size == 37
    assert search_batch_size(out_of_memory_above(10**6), max_size=300).size == 300
    assert search_batch_size(out_of_memory_above(10**6), start=5, max_size=5).trials == [(5, True)]


def test_no_size_that_fits_and_other_errors_are_raised() -> None:
    with pytest.raises(RuntimeError, match="Even a batch of 1 ran out of memory"):
        search_batch_size(out_of_memory_above(0), start=8)

    def broken(size: int) -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        search_batch_size(broken)


def test_is_oom_is_injectable() -> None:
    def trial(size: int) -> None:
        if size > 5:
            raise MemoryError("my allocator is full")

    result = search_batch_size(trial, is_oom=lambda error: isinstance(error, MemoryError))
    assert result.size == 5


def test_the_default_oom_test_knows_torch_s_errors_and_messages() -> None:
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert is_out_of_memory(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"))
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))


class FailsAbove(MLPStep):
    """Trains for real up to ``limit`` samples a batch; above, raises torch's out-of-memory error (or ``error``)."""

    def __init__(self, limit: int, error: Exception | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.error = error

    def training_step(self, batch: Any) -> torch.Tensor:
        if len(batch[0]) > self.limit:
            raise self.error or torch.cuda.OutOfMemoryError(f"CUDA out of memory (batch of {len(batch[0])}).")
        return super().training_step(batch)


def test_batch_size_find_trains_each_size_and_leaves_the_step_untouched() -> None:
    step = FailsAbove(limit=37)
    weights = parameters(step.model)
    optimizer, scheduler = step.optimizer.state_dict(), step.scheduler.state_dict()
    torch.manual_seed(3)
    result = batch_size_find(FakeEngine(), step, regression(samples=100), steps_per_trial=2)
    rng_after = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(rng_after, torch.rand(2))
    assert result.size == 37
    assert step.batch_sizes == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 36, 36, 37, 37]  # trained ones only
    assert_bitwise_equal(parameters(step.model), weights)
    assert step.optimizer.state_dict() == optimizer and step.scheduler.state_dict() == scheduler
    assert all(parameter.grad is None for parameter in step.model.parameters())


def test_batch_size_find_stops_at_the_dataset_length() -> None:
    result = batch_size_find(FakeEngine(), FailsAbove(limit=10**6), regression(samples=50))
    assert result.size == 50 and result.trials[-1] == (50, True)
    with pytest.raises(ValueError, match=r"batch_size_find\(start=64\) is larger than the dataset \(50 samples\)"):
        batch_size_find(FakeEngine(), FailsAbove(limit=10**6), regression(samples=50), start=64)


def test_a_max_size_above_the_dataset_length_is_lowered_to_it_with_a_warning() -> None:
    with pytest.warns(
        CadenceWarning, match=r"batch_size_find\(max_size=64\) is larger than the dataset \(16 samples\)"
    ) as seen:
        result = batch_size_find(FakeEngine(), FailsAbove(limit=10**6), regression(samples=16), max_size=64)
    assert seen[0].filename == __file__
    assert result.size == 16 and max(size for size, _ in result.trials) == 16


def test_a_finder_that_raises_still_puts_the_step_back() -> None:
    step = FailsAbove(limit=8, error=ValueError("a bug in the step"))
    weights = parameters(step.model)
    with pytest.raises(ValueError, match="a bug in the step"):
        batch_size_find(FakeEngine(), step, regression(samples=100))
    assert step.batch_sizes == [1, 1, 2, 2, 4, 4, 8, 8]  # it trained before it failed
    assert_bitwise_equal(parameters(step.model), weights)
    assert step.optimizer.state_dict()["state"] == {}


def loader_with_a_generator(holder: str) -> tuple[DataLoader[Any], torch.Generator]:
    data, generator = regression(samples=96), torch.Generator().manual_seed(7)
    if holder == "loader":
        return DataLoader(data, batch_size=32, shuffle=True, generator=generator), generator
    if holder == "sampler":
        return DataLoader(data, batch_size=32, sampler=RandomSampler(data, generator=generator)), generator
    sampler = BatchSampler(RandomSampler(data, generator=generator), batch_size=32, drop_last=False)
    return DataLoader(data, batch_sampler=sampler), generator


@pytest.mark.parametrize("holder", ["loader", "sampler", "batch_sampler"])
def test_lr_find_puts_back_the_generator_the_dataloader_shuffles_with(holder: str) -> None:
    loader, generator = loader_with_a_generator(holder)
    before = generator.get_state()
    lr_find(FakeEngine(), MLPStep(), loader, num_steps=5, plot=False)
    assert torch.equal(generator.get_state(), before)


@pytest.mark.parametrize("holder", ["loader", "sampler"])
def test_a_fit_after_lr_find_with_a_seeded_generator_is_bitwise_the_fit_without_it(holder: str) -> None:
    # fit() draws its shuffling seed from the loader's generator: a sweep that advanced it would reorder the data.
    def fit(finder_first: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        engine, step = FakeEngine(), MLPStep()
        loader, _ = loader_with_a_generator(holder)
        if finder_first:
            lr_find(engine, step, loader, num_steps=5, plot=False)
        engine.fit(step, loader, max_epochs=2)
        return parameters(step.model)

    assert_bitwise_equal(fit(finder_first=True), fit(finder_first=False))


class CountingStep(SGDStep):
    """Counts its calls in a non-persistent buffer, which state_dict leaves out."""

    def __init__(self) -> None:
        super().__init__(0)
        self.model.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=False)

    def training_step(self, batch: Any) -> torch.Tensor:
        self.model.calls += 1
        return super().training_step(batch)


def test_both_finders_put_back_non_persistent_buffers() -> None:
    step = CountingStep()
    lr_find(FakeEngine(), step, shuffled(), num_steps=5, plot=False)
    assert int(step.model.calls) == 0
    batch_size_find(FakeEngine(), step, regression(samples=16))
    assert int(step.model.calls) == 0 and len(step.batch_sizes) > 5


def test_a_finder_on_cuda_puts_back_cuda_s_generators_even_before_cuda_starts() -> None:
    # Not initialised before the finder, CUDA starts when the model moves there; its generators must still be kept.
    assert _captures_cuda_rng(torch.device("cuda")) and _captures_cuda_rng(torch.device("cuda", 1))
    assert not _captures_cuda_rng(torch.device("cpu")) and not _captures_cuda_rng(torch.device("mps"))


@pytest.mark.slow
def test_the_default_install_stays_light(tmp_path: Path) -> None:
    # A fresh interpreter: importing cadence, its callbacks and tune, and an lr_find without a plot, load no matplotlib.
    script = textwrap.dedent(
        """
        import sys
        import torch
        from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset
        import cadence, cadence.callbacks, cadence.tune
        from cadence.testing import FakeEngine, TinyStep

        data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)
        cadence.tune.lr_find(FakeEngine(), TinyStep(), data, num_steps=10, plot=False)
        print(sorted(name for name in sys.modules if name.split(".")[0] == "matplotlib"))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def lazy_step() -> MLPStep:
    step = MLPStep()
    step.model = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.LazyLinear(1))
    step.optimizer = torch.optim.Adam(step.model.parameters(), lr=0.01)
    step.scheduler = None
    return step


def test_both_finders_refuse_a_lazy_model_not_yet_initialised_and_leave_it_lazy(tmp_path: Path) -> None:
    # Once materialised a lazy module is another class: the finder could not put it back as it was.
    step = lazy_step()
    for finder, data in ((lr_find, shuffled()), (batch_size_find, regression(samples=64))):
        with pytest.raises(
            ValueError,
            match=r"\(\) needs a model whose parameters exist, but 0.weight, 0.bias, "
            r"2.weight and 1 more belong to lazy modules .* Run one forward pass on a batch first",
        ):
            finder(FakeEngine(project_dir=tmp_path), step, data)  # type: ignore[operator]
        assert all(is_lazy(parameter) for parameter in step.model.parameters())
    assert step.batch_sizes == [] and not list(tmp_path.iterdir())


def test_a_lazy_model_run_once_is_searched_and_put_back() -> None:
    step = lazy_step()
    with torch.no_grad():
        step.model(torch.zeros(1, 8))
    weights = parameters(step.model)
    result = lr_find(FakeEngine(), step, shuffled(samples=64), num_steps=10, plot=False)
    assert len(result.lrs) == 10
    assert_bitwise_equal(parameters(step.model), weights)


def warming_up(kind: str) -> MLPStep:
    step = MLPStep(lr=0.01)
    if kind == "LinearLR":
        step.scheduler = torch.optim.lr_scheduler.LinearLR(step.optimizer, start_factor=0.1, total_iters=5)
    else:  # transformers' get_linear_schedule_with_warmup: a LambdaLR from 0
        step.scheduler = cadence.Schedule(torch.optim.lr_scheduler.LambdaLR(step.optimizer, lambda s: min(1.0, s / 5)))
    return step


@pytest.mark.parametrize(("kind", "start"), [("LinearLR", "0.001"), ("LambdaLR", "0")])
def test_lr_find_warns_that_a_warmup_scheduler_is_left_out(kind: str, start: str) -> None:
    with pytest.warns(
        CadenceWarning,
        match=rf"lr_find: the scheduler \({kind}\) warms up, from lr {start} to 0.01, "
        r"but .* runs without the warmup\. The suggestion is the rate to warm up to",
    ) as seen:
        lr_find(FakeEngine(), warming_up(kind), shuffled(samples=64), num_steps=10, plot=False)
    assert len(seen) == 1 and seen[0].filename == __file__


def test_lr_find_says_nothing_of_a_scheduler_that_does_not_warm_up() -> None:
    lr_find(FakeEngine(), MLPStep(), shuffled(samples=64), num_steps=10, plot=False)  # StepLR: warnings are errors
