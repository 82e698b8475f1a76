"""``torch.compile`` with the engine: ``Engine(compile=...)`` and models compiled before ``prepare``. Training
matches an uncompiled plain loop, checkpoints and exports keep the model's own keys (no ``_orig_mod.``) and move
between compiled and uncompiled runs, accumulation still reaches the strategy's module, bad settings are refused."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import cadence
from cadence.accelerate import load_checkpoint_in_model
from cadence.callbacks import GradientAccumulation, MixedPrecision
from cadence.strategies import SingleDevice
from cadence.testing.spawn import spawn
from tests.helpers import RegressionStep, loader, make_model, make_optimizer, parameters

MODEL_KEYS = ["0.weight", "0.bias", "2.weight", "2.bias"]


class CountingBackend:
    """A torch.compile backend that counts the graphs it compiles and runs them with AOT autograd (eagerly)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        return lookup_backend("aot_eager")(graph, example_inputs)  # type: ignore[no-any-return]


def plain_loop(model: nn.Module, accumulation: int = 1, epochs: int = 1) -> list[torch.Tensor]:
    """Uncompiled PyTorch: the reference every compiled run must match (windows of ``accumulation`` batches,
    a short last window divided by its own length, as GradientAccumulation does)."""
    optimizer = make_optimizer(model)
    batches = list(loader())
    for _ in range(epochs):
        for start in range(0, len(batches), accumulation):
            window = batches[start : start + accumulation]
            for inputs, targets in window:
                (nn.functional.mse_loss(model(inputs), targets) / len(window)).backward()
            optimizer.step()
            optimizer.zero_grad()
    return parameters(model)


def engine(tmp_path: Path, compile: Any = False, **kwargs: Any) -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", project_dir=tmp_path, progress_bar=False, compile=compile, **kwargs)


def saved_keys(checkpoint: Path, name: str) -> list[str]:
    with safe_open(str(checkpoint / name), framework="pt") as weights:
        return sorted(weights.keys())


def assert_close(left: list[torch.Tensor], right: list[torch.Tensor]) -> None:
    assert len(left) == len(right)
    for a, b in zip(left, right, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --- training ----------------------------------------------------------------------------------------------------
def test_a_compiled_engine_trains_like_an_uncompiled_plain_loop(tmp_path: Path) -> None:
    backend = CountingBackend()
    compiled = engine(tmp_path, compile={"backend": backend}, callbacks=[GradientAccumulation(2)])
    step = RegressionStep()
    model = step.model
    compiled.fit(step, loader(), max_epochs=2)
    assert backend.graphs >= 1  # the forward really went through torch.compile
    assert compiled.unwrap_model(compiled.models[0]) is model
    assert_close(parameters(model), plain_loop(make_model(), accumulation=2, epochs=2))


def test_a_model_compiled_before_prepare_is_recompiled_with_the_users_settings(tmp_path: Path) -> None:
    backend = CountingBackend()
    model = make_model()
    compiled = torch.compile(model, backend=backend)
    run = engine(tmp_path)
    prepared, optimizer, data = run.prepare(compiled, make_optimizer(model), loader())
    for inputs, targets in data:
        run.backward(nn.functional.mse_loss(prepared(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
    assert backend.graphs >= 1
    assert run.unwrap_model(prepared) is model
    assert run.unwrap_model(compiled) is model
    assert_close(parameters(model), plain_loop(make_model()))
    for again in (model, compiled):
        with pytest.raises(ValueError, match="already prepared"):
            run.prepare(again)


def test_a_model_compiled_twice_is_refused_before_anything_changes(tmp_path: Path) -> None:
    model = make_model()
    run = engine(tmp_path, compile={"backend": "eager"})
    with pytest.raises(ValueError, match=r"compiled with torch\.compile\(\) before engine\.prepare\(\).*compile=False"):
        run.prepare(torch.compile(model, backend="eager"))
    assert run.models == ()


class RecordingStrategy(SingleDevice):
    """One device, remembering which module each accumulation micro-step asked to skip gradient sync for."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.no_sync_modules: list[nn.Module] = []

    def no_backward_sync(self, module: nn.Module) -> AbstractContextManager[Any]:
        self.no_sync_modules.append(module)
        return super().no_backward_sync(module)


@pytest.mark.parametrize("compiled_by", ["engine", "user"])
def test_accumulation_reaches_the_strategys_module_under_the_compiled_wrapper(tmp_path: Path, compiled_by: str) -> None:
    strategy = RecordingStrategy()
    model = make_model()
    setting = {"backend": "eager"} if compiled_by == "engine" else False
    run = engine(tmp_path, compile=setting, strategy=strategy, callbacks=[GradientAccumulation(2)])
    given = model if compiled_by == "engine" else torch.compile(model, backend="eager")
    prepared, optimizer, data = run.prepare(given, make_optimizer(model), loader())
    for inputs, targets in data:
        with run.accumulate(prepared):
            run.backward(nn.functional.mse_loss(prepared(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
    # 5 batches in windows of 2: micro-steps at batches 0 and 2, each given what setup_module returned.
    assert strategy.no_sync_modules == [model, model]


def test_mixed_precision_runs_the_compiled_model_under_autocast(tmp_path: Path) -> None:
    results = []
    for setting in ({"backend": "aot_eager"}, False):
        step = RegressionStep()
        model = step.model
        run = engine(tmp_path / str(bool(setting)), compile=setting, callbacks=[MixedPrecision("bf16")])
        run.fit(step, loader(), max_steps=3)
        assert run.unwrap_model(run.models[0]) is model
        results.append(parameters(model))
    for compiled, plain in zip(*results, strict=True):
        torch.testing.assert_close(compiled, plain, rtol=1e-2, atol=1e-3)


# --- checkpoints and exports ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("saved_compiled", "loaded_compiled"), [(True, False), (False, True), (True, True)])
def test_checkpoints_move_between_compiled_and_uncompiled_runs(
    tmp_path: Path, saved_compiled: bool, loaded_compiled: bool
) -> None:
    setting = {"backend": "aot_eager"}
    reference = RegressionStep()
    engine(tmp_path / "straight").fit(reference, loader(), max_steps=8)

    first = engine(tmp_path / "first", compile=setting if saved_compiled else False)
    first.fit(RegressionStep(), loader(), max_steps=3)
    checkpoint = first.save_state(tmp_path / "checkpoint")
    assert saved_keys(checkpoint, "model_0.safetensors") == sorted(MODEL_KEYS)

    resumed = RegressionStep(seed=7)  # other weights: the checkpoint must replace them
    model = resumed.model
    engine(tmp_path / "second", compile=setting if loaded_compiled else False).fit(
        resumed, loader(), max_steps=8, resume=checkpoint
    )
    assert_close(parameters(model), parameters(reference.model))


@pytest.mark.parametrize("compiled_by", ["engine", "user"])
def test_save_model_writes_the_models_own_keys_and_loads_into_compiled_and_plain_models(
    tmp_path: Path, compiled_by: str
) -> None:
    model = make_model()
    run = engine(tmp_path, compile={"backend": "eager"} if compiled_by == "engine" else False)
    prepared = run.prepare(model if compiled_by == "engine" else torch.compile(model, backend="eager"))
    files = run.save_model(prepared, tmp_path / "export")
    assert saved_keys(tmp_path / "export", files[0].name) == sorted(MODEL_KEYS)
    for target in (torch.compile(make_model(seed=3), backend="eager"), make_model(seed=3)):
        load_checkpoint_in_model(target, tmp_path / "export")
        assert_close(parameters(target), parameters(model))
    # And back: weights exported from a plain model load into the prepared, compiled one.
    plain = make_model(seed=5)
    engine(tmp_path / "plain").save_model(plain, tmp_path / "plain_export")
    load_checkpoint_in_model(prepared, tmp_path / "plain_export")
    assert_close(parameters(model), parameters(plain))


# --- bad settings --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "error", "message"),
    [
        ("inductor", TypeError, r"compile=\.\.\.\) must be True, False or a dict of torch\.compile arguments"),
        (1, TypeError, r"must be True, False or a dict"),
        ({"backnd": "eager"}, ValueError, r"got 'backnd', which torch\.compile does not take.*backend, mode"),
        ({"backend": "no_such_backend"}, ValueError, r"torch\.compile refuses these arguments: Invalid backend"),
        ({"mode": "fastest"}, ValueError, r"refuses these arguments: Unrecognized mode=fastest.*compile=True"),
        ({"mode": "default", "options": {}}, ValueError, r"Either mode or options"),
    ],
)
def test_bad_compile_settings_are_refused_when_the_engine_is_built(
    tmp_path: Path, setting: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        engine(tmp_path, compile=setting)


def test_a_python_torch_compile_does_not_support_is_refused_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._dynamo.eval_frame

    def unsupported() -> None:
        raise RuntimeError("Python 3.99+ not yet supported for torch.compile")

    monkeypatch.setattr(torch._dynamo.eval_frame, "check_if_dynamo_supported", unsupported)
    with pytest.raises(
        RuntimeError, match=r"not yet supported for torch\.compile\. Build the Engine with compile=False"
    ):
        engine(tmp_path, compile=True)


class GraphBreak(nn.Module):
    """A model torch.compile cannot capture in one graph (fullgraph=True refuses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return self.linear(inputs)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
@pytest.mark.parametrize(
    ("compiled_by", "advice"),
    [("engine", r"build the Engine with compile=False"), ("user", r"pass the uncompiled model to prepare\(\)")],
)
def test_a_model_that_cannot_compile_raises_torchs_error_with_the_fix(
    tmp_path: Path, compiled_by: str, advice: str
) -> None:
    import torch._dynamo.exc

    setting = {"backend": "eager", "fullgraph": True}
    run = engine(tmp_path, compile=setting if compiled_by == "engine" else False)
    model = GraphBreak()
    prepared = run.prepare(model if compiled_by == "engine" else torch.compile(model, **setting))
    with pytest.raises(torch._dynamo.exc.Unsupported) as raised:  # torch's own error, not hidden
        prepared(torch.randn(3, 4))
    assert any(re.search(advice, note) for note in raised.value.__notes__)


# --- slow: the default backend, and DDP ----------------------------------------------------------------------------
@pytest.mark.slow
def test_inductor_trains_like_an_uncompiled_plain_loop(tmp_path: Path) -> None:
    step = RegressionStep()
    engine(tmp_path, compile=True).fit(step, loader(), max_epochs=1)  # torch's default backend, inductor
    assert_close(parameters(step.model), plain_loop(make_model()))


PER_RANK, WINDOW = 4, 2


def ddp_compiled_accumulation(directory: str) -> dict[str, Any]:
    """One rank of DDP with Engine(compile=...) and accumulation: the gradients right after a micro-step (local,
    so they differ by rank when no_sync works), the global batches seen, the final weights and an export."""
    run = cadence.Engine(
        accelerator="cpu",
        strategy="ddp",
        compile={"backend": "aot_eager"},
        callbacks=[GradientAccumulation(WINDOW)],
        progress_bar=False,
    )
    model = make_model()
    prepared, optimizer, data = run.prepare(model, make_optimizer(model), loader(batch_size=PER_RANK))
    micro_step_gradients: list[torch.Tensor] = []
    batches = []
    for inputs, targets in data:
        with run.accumulate(prepared):
            run.backward(nn.functional.mse_loss(prepared(inputs), targets))
        if not run.state.sync_gradients and not micro_step_gradients:
            micro_step_gradients = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        batches.append(torch.cat([run.gather(inputs), run.gather(targets)], dim=1))
        optimizer.step()
        optimizer.zero_grad()
    run.save_model(prepared, directory)
    return {"micro": micro_step_gradients, "batches": batches, "weights": parameters(model)}


def fsdp_compiled(directory: str) -> dict[str, Any]:
    """One rank of FSDP2 with Engine(compile=...): the global batches seen, the full weights, a sharded checkpoint."""
    run = cadence.Engine(accelerator="cpu", strategy="fsdp", compile={"backend": "aot_eager"}, progress_bar=False)
    model = make_model()
    prepared, optimizer, data = run.prepare(model, make_optimizer(model), loader(batch_size=PER_RANK))
    batches = []
    for inputs, targets in data:
        run.backward(nn.functional.mse_loss(prepared(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
        batches.append(torch.cat([run.gather(inputs), run.gather(targets)], dim=1))
    run.save_state(directory)
    weights = run.strategy.model_state_dict(run.unwrap_model(prepared))
    return {"batches": batches, "weights": [weights[key].clone() for key in MODEL_KEYS]}


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Any]]]:
    """Both 2-rank jobs in one start of 2 ranks (starting them costs more than the jobs)."""
    from tests.distributed import workers

    root = tmp_path_factory.mktemp("compiled")
    jobs = [
        ("ddp", ddp_compiled_accumulation, (str(root / "ddp_export"),)),
        ("fsdp", fsdp_compiled, (str(root / "fsdp_checkpoint"),)),
    ]
    return root, workers.results_by_job(spawn(2, workers.run_jobs, jobs, timeout=600.0))


def one_process(batches: list[torch.Tensor], window: int = 1) -> list[torch.Tensor]:
    """The plain loop over the global batches the ranks saw together, in windows of ``window``."""
    model = make_model()
    optimizer = make_optimizer(model)
    for start in range(0, len(batches), window):
        chunk = batches[start : start + window]
        for batch in chunk:
            (nn.functional.mse_loss(model(batch[:, :4]), batch[:, 4:]) / len(chunk)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return parameters(model)


@pytest.mark.slow
def test_ddp_compiled_with_accumulation_matches_one_process(
    distributed: tuple[Path, dict[str, list[Any]]],
) -> None:
    root, jobs = distributed
    ranks = jobs["ddp"]
    assert_close(ranks[0]["weights"], ranks[1]["weights"])
    # no_sync reached DDP under the compiled wrapper: after a micro-step each rank holds its own gradients.
    assert any(not torch.equal(a, b) for a, b in zip(ranks[0]["micro"], ranks[1]["micro"], strict=True))
    assert_close(ranks[0]["weights"], one_process(ranks[0]["batches"], WINDOW))
    assert saved_keys(root / "ddp_export", "model.safetensors") == sorted(MODEL_KEYS)


@pytest.mark.slow
def test_fsdp_compiled_matches_one_process_and_resumes_uncompiled(
    tmp_path: Path, distributed: tuple[Path, dict[str, list[Any]]]
) -> None:
    root, jobs = distributed
    ranks = jobs["fsdp"]
    assert_close(ranks[0]["weights"], one_process(ranks[0]["batches"]))
    # The sharded checkpoint of the compiled run loads into one uncompiled process.
    run = engine(tmp_path)
    model = make_model(seed=7)
    run.prepare(model, make_optimizer(model), loader())
    run.load_state(root / "fsdp_checkpoint")
    assert_close(parameters(model), ranks[0]["weights"])
