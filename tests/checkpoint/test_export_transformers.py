"""``engine.save_model`` of ``transformers`` models: ``config.json`` (and ``generation_config.json``) beside the
weights, so ``from_pretrained(directory)`` loads the exact model; a config already there is never replaced, and an
export killed after any step never leaves a config beside weights it does not describe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

import cadence
from cadence.checkpoint import export
from tests.helpers import tiny_gpt2

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def gpt2(layers: int = 2) -> Any:
    return tiny_gpt2(layers).eval()


def bert() -> Any:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=16,
    )
    return transformers.BertForMaskedLM(config).eval()


def engine() -> cadence.Engine:
    return cadence.Engine(accelerator="cpu", progress_bar=False)


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize(
    ("build", "auto", "tied"),
    [
        (gpt2, "AutoModelForCausalLM", ("transformer.wte.weight", "lm_head.weight")),
        (bert, "AutoModelForMaskedLM", ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")),
    ],
)
def test_an_export_loads_with_from_pretrained_to_the_same_logits(
    tmp_path: Path, build: Any, auto: str, tied: tuple[str, str]
) -> None:
    model = build()
    written = engine().save_model(model, tmp_path)
    assert {path.name for path in written} >= {"model.safetensors", "config.json"}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    assert model.config.architectures is None  # recorded on a copy: the user's config is unchanged
    loaded = getattr(transformers, auto).from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    assert torch.equal(logits(loaded), logits(model))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as weights:
        stored = set(weights.keys())
    assert len(stored & set(tied)) == 1  # the tied weight once


def test_a_generating_model_gets_its_generation_config(tmp_path: Path) -> None:
    model = gpt2()
    engine().save_model(model, tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["bos_token_id"] == 0 and saved["eos_token_id"] == 0
    assert transformers.GenerationConfig.from_pretrained(tmp_path).to_dict() == model.generation_config.to_dict()


def test_a_plain_module_gets_no_config(tmp_path: Path) -> None:
    written = engine().save_model(nn.Linear(2, 2), tmp_path)
    assert [path.name for path in written] == ["model.safetensors"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.safetensors"]


def test_exporting_again_keeps_the_same_config_and_replaces_the_weights(tmp_path: Path) -> None:
    model = gpt2()
    engine().save_model(model, tmp_path)
    config = (tmp_path / "config.json").read_bytes()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    written = engine().save_model(model, tmp_path)
    assert [path.name for path in written] == ["model.safetensors"]  # the config is already there, as it is
    assert (tmp_path / "config.json").read_bytes() == config
    assert torch.equal(logits(transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()), logits(model))


def test_a_different_config_already_there_is_refused_before_anything_changes(tmp_path: Path) -> None:
    engine().save_model(gpt2(layers=1), tmp_path)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    with pytest.raises(FileExistsError, match=r"config\.json is already there and differs .* Remove it"):
        engine().save_model(gpt2(layers=2), tmp_path)
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_a_config_the_user_wrote_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"mine": true}')
    with pytest.raises(FileExistsError, match=r"config\.json is already there"):
        engine().save_model(gpt2(), tmp_path)
    assert (tmp_path / "config.json").read_text() == '{"mine": true}'
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json"]


def test_a_kill_after_any_step_never_leaves_a_config_beside_other_weights(tmp_path: Path) -> None:
    """Over a weights-only export (of another model), the config comes only once the weights it describes are
    served; the next export clears the killed one's temporary config."""
    old = {name: torch.zeros_like(tensor) for name, tensor in gpt2().state_dict().items()}
    new = gpt2()
    configs = export.model_configs(new, new.state_dict())
    steps = export.plan_export(new.state_dict(), tmp_path, configs=configs).steps
    for killed_after in range(len(steps) + 1):
        directory = tmp_path / f"killed-after-{killed_after}"
        export.save_weights(old, directory)
        for step in export.plan_export(new.state_dict(), directory, configs=configs).steps[:killed_after]:
            step.run()
        if (directory / "config.json").exists():
            assert torch.equal(logits(transformers.GPT2LMHeadModel.from_pretrained(directory).eval()), logits(new))
        export.save_weights(new.state_dict(), directory, configs=configs)
        assert sorted(path.name for path in directory.iterdir()) == [
            "config.json",
            "generation_config.json",
            "model.safetensors",
        ]
