"""What ``Engine.fit()`` adds when the user chose nothing else: the one module the core asks for callbacks.

The core (``src/cadence``) never imports ``cadence.callbacks``. ``fit()`` prints a model summary and shows a progress
bar unless ``Engine(model_summary=False)`` / ``Engine(progress_bar=False)``, so it needs concrete callbacks; it asks
this front-end module for them, with one lazy import at the point of use, instead of looking up an entry point that
an uninstalled checkout lacks.
"""

from __future__ import annotations

from cadence import Callback
from cadence.callbacks.model_summary import ModelSummary
from cadence.callbacks.progress import RichProgressBar

__all__ = ["default_model_summary", "default_progress_bar"]


def default_progress_bar() -> Callback:
    """The bar ``fit()`` adds when no callback shows progress: a ``RichProgressBar`` with its defaults."""
    return RichProgressBar()


def default_model_summary() -> Callback:
    """The summary ``fit()`` prints when no callback summarizes the model: a ``ModelSummary`` with its defaults."""
    return ModelSummary()
