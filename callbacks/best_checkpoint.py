"""The ranking behind ``Checkpoint(monitor=...)``: ``Ranking`` (plain data, no engine) keeps the ``k`` best scores of
a metric and the checkpoints that fell out of them; ``BestCheckpoints`` ties it to an engine's saves: which path a
ranked save committed to, what retention must keep, what to delete, what a resume restores."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from cadence import CadenceWarning
from cadence.extend import PROTECTS_KEY, SCORE_KEY, is_integer, is_number, user_stacklevel

if TYPE_CHECKING:
    from cadence import Engine
    from cadence.extend import PendingCheckpoint

Mode = Literal["min", "max"]
_MODES = ("min", "max")


@dataclass
class Ranked:
    """One checkpoint saved for the ranking: its score, the step it was saved at, and its directory (None until
    the save commits). ``keep``: it was among the best under another mode or monitor, so the ranking never deletes
    it; pushed out of the best, it moves to ``Ranking.kept``. ``periodic``: it is also the step's periodic save
    (``every_n_steps`` / ``every_n_epochs``), kept outside the ranking: pushed out of the best, it is released to
    retention, never deleted by the ranking."""

    score: float
    step: int
    path: Path | None = None
    keep: bool = False
    periodic: bool = False


def check_ranking_arguments(monitor: Any, mode: Any, save_top_k: Any) -> None:
    if not isinstance(monitor, str) or not monitor:
        raise TypeError(f"monitor must be a metric name such as 'val/loss'; got {monitor!r}.")
    if mode not in _MODES:
        raise ValueError(f"mode must be 'min' (lower is better) or 'max' (higher is better); got {mode!r}.")
    if not is_integer(save_top_k) or save_top_k < -1:
        raise ValueError(f"save_top_k must be an int: k >= 1 keeps the k best, 0 none, -1 all; got {save_top_k!r}.")


def read_score(metrics: dict[str, Any], monitor: str) -> float:
    """``metrics[monitor]`` as a float (a one-element tensor is read off its device)."""
    if monitor not in metrics:
        raise ValueError(
            f"Checkpoint(monitor={monitor!r}) found no {monitor!r} among the logged metrics "
            f"({', '.join(sorted(metrics)) or 'none'}). Log it (engine.log({monitor!r}, value), or return it from "
            "validation_step: fit() logs it as 'val/<name>'), or run fit() with a val_dataloader."
        )
    value = metrics[monitor]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if is_number(value):
        return float(value)
    raise TypeError(
        f"Checkpoint(monitor={monitor!r}) ranks by a number; {monitor!r} is {type(value).__name__} {value!r}. "
        "Log a float or a one-element tensor under that name."
    )


class Ranking:
    """The ``k`` best ``Ranked`` checkpoints, best first (``k = -1``: all), and those pushed out (``dropped``)
    waiting to be deleted, except those marked ``keep`` (see ``load_state_dict``): pushed out, they go to ``kept``
    and are never deleted. On a tie the older checkpoint stays ahead; a NaN score never enters."""

    def __init__(self, monitor: str, mode: Mode, k: int) -> None:
        self.monitor, self.mode, self.k = monitor, mode, k
        self.best: list[Ranked] = []
        self.dropped: list[Ranked] = []
        self.kept: list[Ranked] = []

    def better(self, score: float, than: float) -> bool:
        return score < than if self.mode == "min" else score > than

    def enters(self, score: float) -> bool:
        """Would a checkpoint scoring ``score`` be among the ``k`` best?"""
        if math.isnan(score) or self.k == 0:
            return False
        return self.k == -1 or len(self.best) < self.k or self.better(score, self.best[-1].score)

    def add(self, score: float, step: int) -> Ranked:
        """Rank a new checkpoint: into ``best`` if it enters (pushing the worst into ``dropped``, or ``kept``),
        else straight into ``dropped``."""
        entry = Ranked(score, step)
        if not self.enters(score):
            self.dropped.append(entry)
            return entry
        place = next((i for i, held in enumerate(self.best) if self.better(score, held.score)), len(self.best))
        self.best.insert(place, entry)
        if self.k != -1 and len(self.best) > self.k:
            pushed_out = self.best.pop()
            (self.kept if pushed_out.keep else self.dropped).append(pushed_out)
        return entry

    def discard(self, entry: Ranked) -> None:
        """Forget an entry whose save failed."""
        self.best = [held for held in self.best if held is not entry]
        self.dropped = [held for held in self.dropped if held is not entry]

    def copy(self) -> tuple[list[Ranked], list[Ranked], list[Ranked]]:
        return list(self.best), list(self.dropped), list(self.kept)

    def restore(self, lists: tuple[list[Ranked], list[Ranked], list[Ranked]]) -> None:
        self.best, self.dropped, self.kept = list(lists[0]), list(lists[1]), list(lists[2])

    def state_dict(self, current: Ranked | None, root: Path | None) -> dict[str, Any]:
        """JSON-safe. ``current`` (the entry being saved now) is written with no path: it is the checkpoint that
        holds this state. Other entries not committed yet (a failed background save) are left out. Paths under
        ``root`` are written by name, so a moved project directory still resolves them."""

        def encode(entries: list[Ranked]) -> list[dict[str, Any]]:
            return [
                {
                    "score": e.score,
                    "step": e.step,
                    "path": None if e is current else _relative(e.path, root),
                    **({"keep": True} if e.keep else {}),
                    **({"periodic": True} if e.periodic else {}),
                }
                for e in entries
                if e is current or e.path is not None
            ]

        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "best": encode(self.best),
            "dropped": encode(self.dropped),
            "kept": encode(self.kept),
        }

    def load_state_dict(
        self, state: dict[str, Any], current: Path, root: Path, exists: Callable[[Path], bool]
    ) -> tuple[list[Ranked], list[Ranked]]:
        """Restore from ``state``, the entry with no path being ``current``, ranked again under this monitor, mode
        and k (any may have changed since). Under another mode or monitor, the saved best are marked ``keep``:
        chosen by an order that no longer applies, they are never deleted (under another monitor, whose scores
        rank nothing here, they all go to ``kept`` at once). Returns the best entries whose checkpoint no longer
        ``exists`` (left out), and those that went to ``kept`` now."""

        def present(key: str) -> list[Ranked]:
            return [e for e in decoded[key] if e.path is not None and exists(e.path)]

        decoded = {key: [_decode(e, current, root) for e in state.get(key, [])] for key in ("best", "kept", "dropped")}
        for entry in decoded["kept"]:
            entry.keep = True
        best = present("best")
        comparable = state["monitor"] == self.monitor
        for entry in best if not comparable or state["mode"] != self.mode else ():
            entry.keep = True
        self.best, self.dropped, self.kept = [], [], []
        for entry in sorted(best + present("kept") + present("dropped"), key=self._order):
            if comparable and self.enters(entry.score):
                self.best.append(entry)
            else:
                (self.kept if entry.keep else self.dropped).append(entry)
        gone = [e for e in decoded["best"] if not any(e is b for b in best)]
        return gone, [e for e in best if any(e is k for k in self.kept)]

    def _order(self, entry: Ranked) -> tuple[bool, float, int]:
        """Best first, the older first on a tie; NaN (never ranked) last."""
        nan = math.isnan(entry.score)
        return nan, 0.0 if nan else entry.score if self.mode == "min" else -entry.score, entry.step


class BestCheckpoints:
    """A ``Ranking`` over an engine's checkpoints, for one callback (``holder``: its state key)."""

    def __init__(self, monitor: str, mode: Mode, k: int, holder: str) -> None:
        self.ranking = Ranking(monitor, mode, k)
        self.holder = holder
        self.root: Path | None = None  # set in setup: paths under it are saved by name
        self._current: Ranked | None = None  # the entry whose save is snapshotting the state now
        self._awaiting: tuple[Ranked, Path | PendingCheckpoint] | None = None  # a ranked save not settled yet
        self._loaded: dict[str, Any] | None = None

    @property
    def after_validation(self) -> bool:
        """A ``val/`` metric is fresh at ``VALIDATION_END``; any other is scored at the periodic saves."""
        return self.ranking.monitor.startswith("val/")

    def score(self, engine: Engine) -> float:
        """The score every rank ranks by (a save is collective, so every rank must rank alike). Any metric but a
        ``val/`` one is averaged over the ranks, as ``EarlyStopping`` averages it: each rank logs its own batches'
        value, the mean is the whole step's, and both then name the same best. A ``val/`` one, which ``fit()``'s
        validation averaged already, is the main process's."""
        score = read_score(engine.state.metrics, self.ranking.monitor)
        if self.after_validation or engine.world_size == 1:
            return float(engine.broadcast_object(score))
        return float(engine.reduce(torch.tensor(score, dtype=torch.float64, device=engine.device), "mean"))

    def validation_score(self, engine: Engine) -> float | None:
        """The fresh score if a checkpoint should be saved for it (it enters the best k), else None."""
        score = self.score(engine)
        if math.isnan(score):
            warnings.warn(
                f"Checkpoint(monitor={self.ranking.monitor!r}): the score at step {engine.state.step} is NaN; it is "
                "not ranked and no checkpoint is saved for it.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
        return score if self.ranking.enters(score) else None

    def save(
        self, engine: Engine, score: float, save: Callable[[], Path | PendingCheckpoint], periodic: bool = False
    ) -> None:
        """Rank a checkpoint scoring ``score`` and ``save()`` it; a failed save leaves the ranking as it was.
        ``periodic``: the save is the step's periodic one too (see ``Ranked.periodic``)."""
        try:
            # The save before this one commits first (save() would wait for it anyway), so what this one pushes
            # out of the best k is never deleted before this one is committed.
            engine.wait_for_checkpoint()
        finally:
            self.settle(engine)  # forgets that save if it failed
        before = self.ranking.copy()
        entry = self._current = self.ranking.add(score, engine.state.step)
        entry.periodic = periodic
        try:
            saved = save()
        except BaseException:
            self.ranking.restore(before)
            self.settle(engine)  # an earlier background save that failed is forgotten too
            raise
        finally:
            self._current = None
        self._awaiting = (entry, saved)
        if isinstance(saved, Path):
            self.settle(engine)

    def settle(self, engine: Engine) -> None:
        """Once the ranked save committed: record its path, protect it from retention if it is among the best,
        and delete what fell out. Called at every ``SAVE_STATE``: each save may make an older one deletable."""
        if self._awaiting is not None:
            entry, saved = self._awaiting
            if not isinstance(saved, Path) and not saved.done():
                return  # still being written: its SAVE_STATE settles it
            self._awaiting = None
            try:
                entry.path = saved if isinstance(saved, Path) else saved.result()
            except Exception:  # the engine raises a failed background save itself, where it waits for it
                self.ranking.discard(entry)
                return
            if any(held is entry for held in self.ranking.best):
                engine.checkpoints.protect(entry.path, self.holder)
        self._delete_dropped(engine)

    def _delete_dropped(self, engine: Engine) -> None:
        numbered = engine.checkpoints.numbered()
        newest = numbered[0][1].absolute() if numbered else None
        waiting = []
        for entry in self.ranking.dropped:
            if entry.path is None or entry.path.absolute() == newest:
                waiting.append(entry)  # not committed yet, or still what resume="latest" finds
                continue
            engine.checkpoints.release(entry.path, self.holder)
            if engine.is_main_process and not entry.periodic:  # one process deletes; every rank forgets it
                engine.checkpoints.delete(entry.path)
        self.ranking.dropped = waiting

    def state_dict(self) -> dict[str, Any]:
        current, ranking = self._current, self.ranking
        return {
            "ranking": ranking.state_dict(current, self.root),
            # What CheckpointDirectory.best() and `cadence checkpoint list` read from disk: the score of the
            # checkpoint this state is saved in, and what retention spares.
            SCORE_KEY: None
            if current is None or math.isnan(current.score)
            else {"monitor": ranking.monitor, "value": current.score, "mode": ranking.mode},
            PROTECTS_KEY: [
                None if entry is current else _relative(entry.path, self.root)
                for entry in (*ranking.best, *ranking.kept)
                if entry is current or entry.path is not None
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded = state.get("ranking")
        if loaded is not None and not _well_formed(loaded):
            # The run is being restored already: a hand-edited ranking must not stop it half-way.
            warnings.warn(
                f"Checkpoint(monitor={self.ranking.monitor!r}): the checkpoint's ranking is malformed "
                f"({loaded!r:.80}); the ranking starts afresh.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
            loaded = None
        self._loaded = loaded  # its paths resolve against the loaded checkpoint: restore()

    def restore(self, engine: Engine) -> None:
        """At ``LOAD_STATE``: the ranking as the loaded checkpoint saved it, protected again; a best checkpoint
        deleted since is left out with a warning."""
        loaded, self._loaded = self._loaded, None
        current = engine.state.checkpoint_dir
        if loaded is None or current is None:
            return
        checkpoints = engine.checkpoints
        for entry in (*self.ranking.best, *self.ranking.kept):
            if entry.path is not None:
                checkpoints.release(entry.path, self.holder)
        gone, set_aside = self.ranking.load_state_dict(loaded, current, checkpoints.root, checkpoints.is_checkpoint)
        for entry in gone:
            warnings.warn(
                f"Checkpoint(monitor={self.ranking.monitor!r}): the ranked checkpoint {entry.path} (score "
                f"{entry.score}, step {entry.step}) is gone; it is left out of the ranking.",
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
        if engine.is_main_process and (loaded["monitor"], loaded["mode"]) != (self.ranking.monitor, self.ranking.mode):
            warnings.warn(
                self._reranked(loaded["monitor"], loaded["mode"], set_aside),
                CadenceWarning,
                stacklevel=user_stacklevel(),
            )
        for entry in (*self.ranking.best, *self.ranking.kept):
            if entry.path is not None:
                checkpoints.protect(entry.path, self.holder)

    def _reranked(self, monitor: str, mode: Mode, set_aside: list[Ranked]) -> str:
        """What a resume did with a ranking saved under another monitor or mode."""
        ranking = self.ranking
        intro = f"Checkpoint(monitor={ranking.monitor!r}, mode={ranking.mode!r}): the checkpoint's ranking"
        if monitor != ranking.monitor:
            return (
                f"{intro} is by {monitor!r}, whose scores cannot rank {ranking.monitor!r}: the ranking starts afresh, "
                f"and its best checkpoints ({_listed(set_aside) or 'none left'}) are kept; this run never deletes them."
            )
        marked = [entry for entry in (*ranking.best, *ranking.kept) if entry.keep]
        fell_out = f"; {_listed(set_aside)} already fell out of them" if set_aside else ""
        return (
            f"{intro} was made with mode={mode!r}. Its best checkpoints ({_listed(marked)}) are ranked again with "
            f"mode={ranking.mode!r} and kept even when they fall out of the save_top_k={ranking.k} best{fell_out}: "
            "this run never deletes them (delete them by hand once they are no longer needed). To rank as before, "
            f"resume with Checkpoint(monitor={monitor!r}, mode={mode!r})."
        )


def _well_formed(state: Any) -> bool:
    def entry(e: Any) -> bool:
        return (
            isinstance(e, dict)
            and isinstance(e.get("score"), (int, float))
            and isinstance(e.get("step"), int)
            and (e.get("path") is None or isinstance(e.get("path"), str))
            and isinstance(e.get("keep", False), bool)
            and isinstance(e.get("periodic", False), bool)
        )

    if not isinstance(state, dict) or not isinstance(state.get("monitor"), str) or state.get("mode") not in _MODES:
        return False
    lists = [state.get("best"), state.get("dropped"), state.get("kept", [])]  # no "kept" before it was recorded
    return all(isinstance(entries, list) and all(entry(e) for e in entries) for entries in lists)


def _listed(entries: list[Ranked]) -> str:
    return ", ".join(f"{entry.path and entry.path.name} (score {entry.score}, step {entry.step})" for entry in entries)


def _relative(path: Path | None, root: Path | None) -> str | None:
    if path is None:
        return None
    if root is not None and path.absolute().parent == root.absolute():
        return path.name
    return str(path.absolute())


def _decode(entry: dict[str, Any], current: Path, root: Path) -> Ranked:
    path = current if entry["path"] is None else root / entry["path"]  # an absolute path stays as it is
    return Ranked(
        float(entry["score"]),
        int(entry["step"]),
        path,
        keep=entry.get("keep") is True,
        periodic=entry.get("periodic") is True,
    )
