"""Helpers to test a callback alone: ``FakeEngine`` and ``RecordingCallback`` ship with the package."""

from cadence.testing.fake_engine import FakeEngine, FakeStrategy, TinyStep, tiny_dataloader
from cadence.testing.recording import RecordingCallback

__all__ = ["FakeEngine", "FakeStrategy", "RecordingCallback", "TinyStep", "tiny_dataloader"]
