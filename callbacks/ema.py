"""``EMA``: an exponential moving average of the weights, kept in fp32, swapped in for validation, ``test()``,
``predict()`` and export."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from cadence import Callback
from cadence.extend import check_state_fields, foreach_copy_, foreach_lerp_, integer, is_number

if TYPE_CHECKING:
    from cadence import Engine


class EMA(Callback):
    """Keeps ``ema = decay * ema + (1 - decay) * weights`` (a fused lerp, as timm's ModelEmaV3) of
    every floating-point parameter of the prepared models that a prepared optimizer updates, in fp32.

    The average starts from the weights at ``state.step == start_step`` (the initial weights by default) and is
    updated after every ``every_n_steps``-th real optimizer update from there: a skipped step (accumulation
    micro-step, fp16 overflow, veto) changes nothing. Each optimizer's update averages its own parameters.
    Buffers (BatchNorm statistics) are not averaged: the averaged model uses the live ones, as Composer's EMA,
    which copies them. Under FSDP each rank keeps the average of its own shards, and updates it locally.

    Validation in ``fit()`` runs on the averaged weights; the trained ones are put back at ``VALIDATION_END``, or
    at ``EXCEPTION`` / ``FIT_END`` when validation fails. ``engine.test()`` and ``engine.predict()`` run on them too
    (swapped in at ``TEST_START`` / ``PREDICT_START``, out at ``TEST_END`` / ``PREDICT_END``, which follow a failure
    as well). ``with ema.average_weights(): ...`` does the same by hand:
    ``engine.save_model(model, directory)`` inside it exports the averaged weights. Swapping keeps one copy of the
    trained weights (this rank's shards) aside meanwhile.

    Checkpoints hold the full average (gathered from every rank's shards on save, cut again on load, so a run may
    resume on another world size or strategy), and always the trained weights as the model's: a save made while
    the average is swapped in puts the trained weights back first.

    Args:
        decay: the weight of the average at each update, in (0, 1): 0.999 averages over about 1000 updates.
        every_n_steps: update the average after every n-th real optimizer update.
        start_step: the ``state.step`` whose weights start the average.

    Example:
        ```python
        ema = EMA(decay=0.999)
        engine = cadence.Engine(callbacks=[ema])
        engine.fit(step, train, val_dataloader=val, max_epochs=3)  # validation runs on the average
        with ema.average_weights():
            engine.save_model(step.model, "ema_model")
        ```
    """

    def __init__(self, decay: float, every_n_steps: int = 1, start_step: int = 0) -> None:
        if not is_number(decay) or not 0 < decay < 1:
            raise ValueError(f"EMA(decay=...) must be a number strictly between 0 and 1 (e.g. 0.999); got {decay!r}.")
        self.decay = float(decay)
        self.every_n_steps = integer("EMA", "every_n_steps", every_n_steps)
        self.start_step = integer("EMA", "start_step", start_step, least=0)
        self._engine: Engine | None = None
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._shadow: list[torch.Tensor] | None = None
        self._by_optimizer: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._trained: list[torch.Tensor] | None = None  # the trained weights' local shards, while the average is in

    def setup(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def started(self) -> bool:
        """True once the average exists (``state.step`` reached ``start_step``); before, it is the weights."""
        return self._shadow is not None

    # --- averaging -----------------------------------------------------------------------------------------
    def _tracked(self, engine: Engine) -> tuple[list[str], list[torch.Tensor]]:
        optimized = {
            id(p) for optimizer in engine.optimizers for group in optimizer.param_groups for p in group["params"]
        }
        names: list[str] = []
        params: list[torch.Tensor] = []
        for index, model in enumerate(engine.models):
            for name, param in engine.unwrap_model(model).named_parameters():
                if id(param) in optimized and param.is_floating_point():
                    names.append(f"{index}.{name}")
                    params.append(param)
        return names, params

    @torch.no_grad()
    def _start(self, engine: Engine) -> list[torch.Tensor]:
        self._names, self._params = self._tracked(engine)
        # A DTensor's copy is sharded like its parameter: each rank holds and updates its own shard.
        self._shadow = [param.detach().to(torch.float32, copy=True) for param in self._params]
        self._by_optimizer = {}
        return self._shadow

    def on_before_optimizer_step(self, engine: Engine) -> None:
        if self._shadow is None and engine.state.step >= self.start_step:
            self._start(engine)  # the weights as of this step, before it changes them

    @torch.no_grad()
    def on_after_optimizer_step(self, engine: Engine) -> None:
        state = engine.state
        if state.skip_reason is not None or state.optimizer is None:
            return
        if self._shadow is None:
            if state.step >= self.start_step:
                self._start(engine)
            return
        if (state.step - self.start_step) % self.every_n_steps:
            return
        shadow, params = self._owned_by(state.optimizer)
        if shadow:
            local = engine.strategy.local_tensor
            weights = [local(p).float() for p in params]  # .float() of an fp32 tensor is the tensor itself
            foreach_lerp_([local(s) for s in shadow], weights, 1.0 - self.decay)

    def _owned_by(self, optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if id(optimizer) not in self._by_optimizer:
            own = {id(p) for group in optimizer.param_groups for p in group["params"]}
            pairs = [(s, p) for s, p in zip(self._shadow or [], self._params, strict=True) if id(p) in own]
            self._by_optimizer[id(optimizer)] = ([s for s, _ in pairs], [p for _, p in pairs])
        return self._by_optimizer[id(optimizer)]

    # --- swapping ------------------------------------------------------------------------------------------
    @contextmanager
    def average_weights(self) -> Iterator[None]:
        """Inside, the prepared models hold the averaged weights (what ``engine.save_model`` exports in it);
        the trained ones come back on leaving, also through an exception. Call it on every rank under FSDP or
        DDP, like ``save_model``. Before the average starts it changes nothing (the average is the weights)."""
        if self._engine is None:
            raise RuntimeError(
                "EMA.average_weights() needs the EMA attached to an engine: Engine(callbacks=[ema]) or "
                "engine.add_callback(ema), then train."
            )
        swapped = self._swap_in(self._engine)
        try:
            yield
        finally:
            if swapped:
                self._swap_out(self._engine)

    @torch.no_grad()
    def _swap_in(self, engine: Engine) -> bool:
        if self._shadow is None or self._trained is not None:
            return False
        local = engine.strategy.local_tensor
        live = [local(p) for p in self._params]
        self._trained = [weight.clone() for weight in live]
        foreach_copy_(live, [local(s) for s in self._shadow])
        _reshard(engine)
        return True

    @torch.no_grad()
    def _swap_out(self, engine: Engine) -> None:
        if self._trained is None:
            return
        foreach_copy_([engine.strategy.local_tensor(p) for p in self._params], self._trained)
        self._trained = None
        _reshard(engine)

    def on_validation_start(self, engine: Engine) -> None:
        self._swap_in(engine)

    def on_validation_end(self, engine: Engine) -> None:
        self._swap_out(engine)

    on_exception = on_fit_end = on_validation_end  # a failed validation must not leave the average in the model

    on_test_start = on_predict_start = on_validation_start
    on_test_end = on_predict_end = on_validation_end

    # --- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The full average, by parameter; every rank calls it (it gathers FSDP shards)."""
        if self._engine is None or self._shadow is None:
            return {}
        self._swap_out(self._engine)  # a checkpoint holds the trained weights as the model's
        full = self._engine.strategy.full_tensor
        return {"weights": {name: full(s) for name, s in zip(self._names, self._shadow, strict=True)}}

    @torch.no_grad()
    def check_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, engine = state_dict.get("weights"), self._engine
        if saved is not None:
            owner = f"callback {self.state_key!r}"
            check_state_fields(owner, state_dict, {"weights": dict})
            check_state_fields(owner, saved, dict.fromkeys(saved, torch.Tensor))
            if engine is None:
                raise RuntimeError("EMA state loads through engine.load_state(): attach the EMA to the engine first.")
            names, params = self._tracked(engine)
            _check_saved(saved, dict(zip(names, params, strict=True)))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.check_state_dict(state_dict)  # load_state checked already; a direct call is checked here
        saved, engine = state_dict.get("weights"), self._engine
        self._trained = None  # the loaded checkpoint's weights are the trained ones now
        self._shadow = None
        if saved is not None and engine is not None:
            strategy = engine.strategy
            for shadow, name in zip(self._start(engine), self._names, strict=True):
                strategy.local_tensor(shadow).copy_(strategy.shard_like(saved[name], shadow))


def _check_saved(saved: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    if saved.keys() != params.keys():
        raise ValueError(
            f"The checkpoint's EMA averages other parameters than this run trains (missing "
            f"{sorted(params.keys() - saved.keys())}, unknown {sorted(saved.keys() - params.keys())}). Resume with "
            "the models and optimizers of the run that saved it (the same parameters, optimized)."
        )
    for name, param in params.items():
        if tuple(saved[name].shape) != tuple(param.shape):
            raise ValueError(
                f"The checkpoint's EMA of {name!r} has shape {tuple(saved[name].shape)}, the parameter "
                f"{tuple(param.shape)}. Resume with the model that saved it."
            )


def _reshard(engine: Engine) -> None:
    """FSDP keeps the root module's gathered weights after a forward without backward (validation), and would
    reuse them: drop every gathered copy, so the next forward gathers the weights just swapped."""
    for model in engine.models:
        engine.strategy.reshard(engine.unwrap_model(model))
