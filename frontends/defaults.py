"""What ``Engine.fit()`` adds when the user chose nothing else: the one module the core asks for a callback.

The core (``src/cadence``) never imports ``cadence.callbacks``. ``fit()`` shows a progress bar unless
``Engine(progress_bar=False)``, so it needs a concrete callback; it asks this front-end module for it, with one
lazy import at the point of use, instead of looking up an entry point that an uninstalled checkout lacks.
"""

from __future__ import annotations

from cadence.callback import Callback
from cadence.callbacks.progress import RichProgressBar

__all__ = ["default_progress_bar"]


def default_progress_bar() -> Callback:
    """The bar ``fit()`` adds when no callback shows progress: a ``RichProgressBar`` with its defaults."""
    return RichProgressBar()
