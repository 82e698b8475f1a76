"""``accelerate.utils.dataclasses``: the configuration classes and ``DistributedType``."""

from cadence.accelerate.plugins import DataLoaderConfiguration, ProjectConfiguration
from cadence.accelerate.state import DistributedType

__all__ = ["DataLoaderConfiguration", "DistributedType", "ProjectConfiguration"]
