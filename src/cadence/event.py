"""The engine's events: this docstring is the training loop, and each member says what holds when it fires.

``Engine.fit`` is written with the same public calls a user makes in a hand-written loop, so the events fire from
the same places in both::

    prepare(model, optimizer, dataloader, scheduler)  # strategy wraps, precision wraps the forward
    FIT_PREPARED                                       # fit() only: prepared, nothing restored yet
    load_state(checkpoint)                             # fit(resume=...) only: LOAD_STATE
    FIT_START                                          # fit() only
    for epoch in ...:
        for batch in dataloader:                       # EPOCH_START before the first batch
                                                       # BATCH_START: batch on the device, sync decided
            with accumulate(model):                    # no gradient sync unless state.sync_gradients
                loss = step.training_step(batch)       # forward under the precision's autocast
                backward(loss)                         # BEFORE_BACKWARD, (loss / divisor) * scale, AFTER_BACKWARD
                optimizer.step()                       # skipped and recorded unless state.sync_gradients;
                                                       # else unscale once, BEFORE_OPTIMIZER_STEP, step,
                                                       # AFTER_OPTIMIZER_STEP
                scheduler.step()                       # steps only if its optimizer really stepped
                optimizer.zero_grad()                  # skipped unless state.sync_gradients
                                                       # BATCH_END: when the next batch is asked for
            VALIDATION_START ... VALIDATION_END        # fit(val_every_n_steps=N): after BATCH_END, every N updates
                                                       # EPOCH_END: when the dataloader is exhausted
        VALIDATION_START ... VALIDATION_END            # fit() only, with a val_dataloader, after every
                                                       # val_every_n_epochs-th epoch, unless it validated at that step
    EXCEPTION                                          # fit() only, when it raises: before FIT_END
    FIT_END                                            # fit() only, once FIT_PREPARED fired, also after an exception
    save_state() -> SAVE_STATE, load_state() -> LOAD_STATE  # after the checkpoint is committed / restored
    log_hyperparams(params) -> LOG_HYPERPARAMS         # whenever called, in or out of fit()

    test(step, dataloader)                             # prepares step.model (if not yet) and its own loader copy
        TEST_START                                     # every prepared model in eval mode, no grad from here
        for batch in dataloader:                       # no epoch or batch event: the State's counters stay
            metrics = step.test_step(batch)            # validation_step when the step has no test_step
            TEST_BATCH_END
        TEST_END                                       # test/<name> in state.metrics; also when test() raises
    predict(step, dataloader)                          # the same pass with predict_step: PREDICT_START,
                                                       # PREDICT_BATCH_END, PREDICT_END; outputs gathered at the end

A prepared dataloader fires the epoch and batch events while a prepared model is in training mode: an
evaluation loop runs after ``model.eval()`` and so never counts as training batches.

Where each event fires: one module per event, the same code for ``fit()`` and for a hand-written loop, so a callback
behaves alike in both (``tests/test_event_places.py`` holds the code to this table)::

    event                  fired by (module: where)                        in fit()         in a hand-written loop
    FIT_PREPARED           loop: _prepared_then_resume                     once             never
    FIT_START              loop: FitRun.run                                once             never
    EPOCH_START            wrappers: PreparedDataLoader._training_batches  each epoch       for batch in loader
    BATCH_START            wrappers: PreparedDataLoader._training_batches  each batch       for batch in loader
    BEFORE_BACKWARD        engine: Engine.backward                         each batch       engine.backward(loss)
    AFTER_BACKWARD         engine: Engine.backward                         each batch       engine.backward(loss)
    BEFORE_OPTIMIZER_STEP  wrappers: PreparedOptimizer.step                each sync step   optimizer.step()
    AFTER_OPTIMIZER_STEP   wrappers: PreparedOptimizer.step                each sync step   optimizer.step()
    BATCH_END              wrappers: PreparedDataLoader._training_batches  each batch       the next batch asked
    EPOCH_END              wrappers: PreparedDataLoader._training_batches  each epoch       the loader exhausted
    VALIDATION_START       loop: FitRun.validate                           each validation  never
    VALIDATION_END         loop: FitRun.validate                           each validation  never
    EXCEPTION              loop: FitRun.run                                when it raises   never
    FIT_END                loop: _finish, _prepared_then_resume            once             never
    TEST_START             evaluation: _pass_with_events                   -                engine.test()
    TEST_BATCH_END         evaluation: _batches                            -                engine.test()
    TEST_END               evaluation: _pass_with_events                   -                engine.test()
    PREDICT_START          evaluation: _pass_with_events                   -                engine.predict()
    PREDICT_BATCH_END      evaluation: _batches                            -                engine.predict()
    PREDICT_END            evaluation: _pass_with_events                   -                engine.predict()
    LOG_HYPERPARAMS        engine: Engine.log_hyperparams                  when called      when called
    SAVE_STATE             checkpoint.background: _after_commit            each commit      each commit
    LOAD_STATE             engine: Engine.load_state                       on resume        engine.load_state()

``cadence.testing.FakeEngine`` fires any event on demand, for tests of a callback alone.
"""

from __future__ import annotations

from enum import Enum

from cadence.attribute_docs import document_members


@document_members
class Event(str, Enum):
    """One member per point in the loop; ``Callback.on_<value>(engine)`` is its hook."""

    FIT_PREPARED = "fit_prepared"
    """Once per ``fit()``, as soon as its objects are prepared: before ``fit(resume=...)`` restores a checkpoint
    (``LOAD_STATE``) and before ``FIT_START``. ``FIT_END`` follows it whatever happens: when a hook here or the
    resume raises, ``fit()`` fires ``FIT_END`` with ``state.exception`` set (but no ``EXCEPTION``: nothing was
    trained, so nothing is saved for it) and re-raises. Take here what must cover the loading too
    (``Preemption`` installs its signal handlers here) and release it at ``FIT_END``."""

    FIT_START = "fit_start"
    """Once per ``fit()``, after preparation and the resume, before the first epoch."""

    EPOCH_START = "epoch_start"
    """A training dataloader is about to yield its first batch; ``state.epoch`` is the new epoch's index."""

    BATCH_START = "batch_start"
    """A training batch is on the device. ``state.batch_idx`` and ``state.is_last_batch`` describe it. Callbacks
    that decide ``state.sync_gradients`` (gradient accumulation) do so here, and only here."""

    BEFORE_BACKWARD = "before_backward"
    """``engine.backward(loss)`` was called: ``state.loss`` and ``state.num_items`` are set and
    ``state.loss_divisor`` is 1. A callback may set ``state.loss_divisor``; the engine divides the loss by it,
    then the precision scales it, then autograd runs."""

    AFTER_BACKWARD = "after_backward"
    """Gradients of this batch are accumulated into ``.grad`` (still scaled under fp16, unsynced on a no-sync
    micro-step)."""

    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    """Fires only on a sync step. Gradients are synced across ranks, unscaled exactly once, and divided by
    ``state.grad_divisor`` when a callback set it: they are the gradients the optimizer will use. Clipping lives
    here. A callback may veto the step with ``state.veto_step(reason)``."""

    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    """Fires only on a sync step, after the step was taken or skipped: ``state.skip_reason`` says which
    (``None`` when the weights were updated) and ``state.step`` counts only real updates."""

    BATCH_END = "batch_end"
    """The loop body for the batch has finished (the next batch was asked for, or the loop ended)."""

    EPOCH_END = "epoch_end"
    """The training dataloader is exhausted."""

    VALIDATION_START = "validation_start"
    """``fit()`` is about to run ``validation_step`` over the validation dataloader (model in eval mode, no
    grad): after a training batch's ``BATCH_END`` every ``val_every_n_steps`` updates, or after ``EPOCH_END``;
    never twice at one ``state.step`` (``FitProgress.validated_step`` is that step)."""

    VALIDATION_END = "validation_end"
    """Validation metrics are in ``state.metrics`` under ``val/<name>``, as Python floats, each the mean over
    the validation samples of every rank (see ``TrainingStep.validation_step``), the same on every rank. At an
    epoch's end, its ``Schedule(interval="epoch")`` has stepped too, and at any validation a ``"step"`` schedule
    on a ``val/`` metric whose turn it is, so a checkpoint taken here holds them; ``state.validation_pending``
    is False again (a checkpoint a step's validation held back is saved here)."""

    FIT_END = "fit_end"
    """``fit()`` is returning, normally or through an exception: release resources here."""

    EXCEPTION = "exception"
    """``fit()`` caught an exception (``state.exception``); it is re-raised after the callbacks ran."""

    TEST_START = "test_start"
    """``engine.test()`` prepared what it needs and put every prepared model in eval mode (gradients off): its
    first batch comes next. ``state.eval_num_batches`` is the pass's length. ``TEST_END`` follows whatever
    happens. The training counters (``step``, ``epoch``, ``batch_idx`` ...) are not touched by the pass."""

    TEST_BATCH_END = "test_batch_end"
    """``test_step`` (or ``validation_step``) ran on the batch at index ``state.eval_batch_idx`` of the test
    pass."""

    TEST_END = "test_end"
    """``engine.test()``'s pass is over. When it succeeded, ``state.metrics`` holds its metrics as
    ``test/<name>``, Python floats, each the mean over the test samples of every rank (the rule of
    ``VALIDATION_END``), the same on every rank; they are taken out again after this event (``test()`` returns
    them), so a checkpoint never holds them. When the pass raised, ``state.exception`` is set here and the error
    is re-raised after. The models return to the modes they had after it."""

    PREDICT_START = "predict_start"
    """``engine.predict()`` prepared what it needs and put every prepared model in eval mode (gradients off):
    its first batch comes next. ``state.eval_num_batches`` is the pass's length. ``PREDICT_END`` follows
    whatever happens; the training counters are not touched."""

    PREDICT_BATCH_END = "predict_batch_end"
    """``predict_step`` ran on the batch at index ``state.eval_batch_idx`` of the predict pass."""

    PREDICT_END = "predict_end"
    """``engine.predict()``'s pass is over (the outputs are gathered after it). When it raised,
    ``state.exception`` is set here and the error is re-raised after. The models return to the modes they had
    after it."""

    LOG_HYPERPARAMS = "log_hyperparams"
    """``engine.log_hyperparams(params)`` merged ``params`` into ``state.hyperparams``; fires on the processes
    that called it, whenever they did (before ``fit()`` too). Loggers write them at their next flush."""

    SAVE_STATE = "save_state"
    """A checkpoint was committed at ``state.checkpoint_dir`` (callbacks' ``state_dict`` went into it). Always
    on the training thread: for a background save (``save_state(blocking=False)``) it fires when the engine next
    waits after the commit (the next save, ``wait_for_checkpoint``, ``load_state``, the end of ``fit()``,
    ``close``)."""

    LOAD_STATE = "load_state"
    """A checkpoint was restored from ``state.checkpoint_dir``: every callback's ``load_state_dict`` ran."""

    @property
    def hook_name(self) -> str:
        """The ``Callback`` method called for this event."""
        return f"on_{self.value}"
