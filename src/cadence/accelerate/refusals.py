"""What ``cadence.accelerate`` does not provide, why, and what to use instead: ``Accelerator`` members and the names
of Accelerate's modules. Asking for one raises an error that says so, never a bare ``AttributeError``."""

from __future__ import annotations

from typing import NoReturn

__all__ = ["MEMBERS", "MODULE_NAMES", "NameNotProvidedError", "NotProvidedError", "refuse_member", "refuse_name"]

_FSDP = "use cadence.Engine(strategy='fsdp') (FSDP2) to shard the model"
_PARALLEL = "cadence runs data parallelism (DDP) or FSDP2 only: Engine(strategy='ddp' | 'fsdp'); use process_index"
_BIG_MODEL = "cadence has no big-model dispatch or offloading; load the model on one device, or shard it with " + _FSDP

# Accelerator members, by name: why cadence has no such member, and the cadence way.
MEMBERS = {
    "deepspeed_plugin": f"cadence has no DeepSpeed integration; {_FSDP}",
    "deepspeed_ulysses_dl_adapter": f"cadence has no DeepSpeed integration; {_FSDP}",
    "lomo_backward": "LOMO optimizers are not supported; call accelerator.backward(loss) with a torch optimizer",
    "fp8_backend": "fp8 training is not supported; use mixed_precision='bf16' or 'fp16'",
    "parallelism_config": _PARALLEL,
    "is_composable_parallelism_enabled": _PARALLEL,
    "torch_device_mesh": _PARALLEL,
    "maybe_context_parallel": "context parallelism is not supported; " + _PARALLEL,
    "context_parallel_rank": _PARALLEL,
    "data_parallel_rank": _PARALLEL,
    "data_parallel_shard_rank": _PARALLEL,
    "tensor_parallel_rank": _PARALLEL,
    "pipeline_parallel_rank": _PARALLEL,
    "verify_device_map": _BIG_MODEL,
    "profile": "use torch.profiler.profile(...) around the steps you want to see, directly",
    "prepare_model": "use accelerator.prepare(model)",
    "prepare_optimizer": "use accelerator.prepare(optimizer)",
    "prepare_scheduler": "use accelerator.prepare(scheduler)",
    "prepare_data_loader": "use accelerator.prepare(dataloader)",
}

# Names users import from ``accelerate`` / ``accelerate.utils`` that cadence does not provide.
MODULE_NAMES = {
    "DeepSpeedPlugin": f"cadence has no DeepSpeed integration; {_FSDP}",
    "DummyOptim": f"cadence has no DeepSpeed integration; {_FSDP}",
    "DummyScheduler": f"cadence has no DeepSpeed integration; {_FSDP}",
    "FullyShardedDataParallelPlugin": f"FSDP plugins are not taken; {_FSDP}",
    "MegatronLMPlugin": f"Megatron-LM is not supported; {_FSDP}",
    "TorchTensorParallelPlugin": f"tensor parallelism is not supported; {_FSDP}",
    "ParallelismConfig": _PARALLEL,
    "DDPCommunicationHookType": "communication hooks are not supported; DDP runs with torch's default all-reduce",
    "ProfileKwargs": "use torch.profiler.profile(...) directly",
    "FP8RecipeKwargs": "fp8 training is not supported; use mixed_precision='bf16' or 'fp16'",
    "cpu_offload": _BIG_MODEL,
    "cpu_offload_with_hook": _BIG_MODEL,
    "disk_offload": _BIG_MODEL,
    "dispatch_model": _BIG_MODEL,
    "infer_auto_device_map": _BIG_MODEL,
    "init_empty_weights": "build the model on the 'meta' device with `with torch.device('meta'):` directly",
    "init_on_device": "use `with torch.device(...):` directly",
    "load_checkpoint_and_dispatch": _BIG_MODEL + "; load weights with cadence.accelerate.load_checkpoint_in_model",
    "prepare_pippy": "pipeline parallelism is not supported; " + _PARALLEL,
    "notebook_launcher": "start processes with `cadence launch --nproc-per-node N script.py` (or torchrun)",
    "debug_launcher": "start processes with `cadence launch --nproc-per-node N script.py` (or torchrun)",
}


class NotProvidedError(AttributeError, NotImplementedError):
    """An Accelerate member cadence does not provide. An ``AttributeError`` so that ``hasattr`` and
    ``getattr(obj, name, default)`` keep working; a ``NotImplementedError`` because that is what it is."""


class NameNotProvidedError(ImportError, NotImplementedError):
    """An Accelerate name cadence's modules do not provide. An ``ImportError``, because ``from module import name``
    replaces an ``AttributeError`` with its own message and would hide the alternative."""


def refuse_member(owner: str, name: str) -> NoReturn:
    """Raise for ``owner.name``: the refusal from ``MEMBERS``, or a plain 'no such member' that says where the
    provided members are listed."""
    if name in MEMBERS:
        raise NotProvidedError(f"cadence.accelerate.{owner} does not provide {name}: {MEMBERS[name]}.", name=name)
    raise AttributeError(
        f"{owner!r} object has no attribute {name!r} (cadence.accelerate.{owner} provides the members listed in "
        "docs/accelerate.md).",
        name=name,
    )


def refuse_name(module: str, name: str) -> NoReturn:
    """Raise for ``module.name``, as ``refuse_member`` does for members."""
    if name in MODULE_NAMES:
        raise NameNotProvidedError(f"{module} does not provide {name}: {MODULE_NAMES[name]}.", name=name)
    raise AttributeError(
        f"module {module!r} has no attribute {name!r} (the names cadence.accelerate provides are listed in "
        "docs/accelerate.md).",
        name=name,
    )
