"""``cadence.accelerate.utils``: the names Accelerate's examples and test scripts import from ``accelerate.utils``."""
