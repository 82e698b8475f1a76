"""Checkpoints: crash-safe directories of JSON and safetensors (``files``), the engine's full state
(``engine_state``), automatic naming (``layout``) and model export (``export``)."""
