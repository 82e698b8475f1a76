"""``cadence.accelerate.utils``: the names Accelerate's examples and test scripts import from ``accelerate.utils``."""

from typing import NoReturn

from cadence.accelerate.refusals import refuse_name
from cadence.accelerate.utils.dataclasses import DataLoaderConfiguration, DistributedType, ProjectConfiguration
from cadence.accelerate.utils.operations import (
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    concatenate,
    convert_to_fp32,
    copy_tensor_to_devices,
    find_batch_size,
    gather,
    gather_object,
    honor_type,
    is_torch_tensor,
    listify,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)

__all__ = [
    "DataLoaderConfiguration",
    "DistributedOperationException",
    "DistributedType",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "find_batch_size",
    "gather",
    "gather_object",
    "honor_type",
    "is_torch_tensor",
    "listify",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
]


def __getattr__(name: str) -> NoReturn:
    refuse_name(__name__, name)
