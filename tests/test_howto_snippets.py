"""The How-to pages' code that promises a behaviour runs as written: the learning-rate scheduler snippet
(docs/howto/loop.md) and the epoch metrics snippet (docs/howto/epoch-metrics.md); the contributing page's Layout
section (docs/contributing.md) names only files that exist."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LOOP = ROOT / "docs" / "howto" / "loop.md"
EPOCH_METRICS = ROOT / "docs" / "howto" / "epoch-metrics.md"
CONTRIBUTING = ROOT / "docs" / "contributing.md"


def snippet(page: Path, heading: str) -> str:
    """The first ``python`` code block after ``heading`` on ``page``."""
    found = re.search(re.escape(heading) + r"\n.*?```python\n(.*?)```", page.read_text(), re.DOTALL)
    assert found is not None, f"{page.relative_to(ROOT)} has no python block under {heading!r}"
    return found.group(1)


def test_the_scheduler_snippet_steps_its_one_cycle_once_per_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the engine's project_dir defaults to the current directory
    code = snippet(LOOP, "## Learning-rate schedulers")
    namespace: dict[str, Any] = {"__name__": "howto"}
    exec(compile(code, str(LOOP), "exec"), namespace)
    step, engine = namespace["step"], namespace["engine"]
    total = 3 * 256 // 32
    assert engine.state.step == total == step.scheduler.scheduler.total_steps
    assert step.scheduler.scheduler.last_epoch == total  # stepped once per update
    plain = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    reference = torch.optim.lr_scheduler.OneCycleLR(plain, max_lr=1e-2, total_steps=total)
    for _ in range(total):
        plain.step()
        reference.step()
    assert step.optimizer.param_groups[0]["lr"] == reference.get_last_lr()[0]
    printed = capsys.readouterr().out.strip()
    assert printed == f"{total} updates, lr {step.optimizer.param_groups[0]['lr']:.2e}"
    assert printed == code.rsplit("# ", 1)[1].strip()  # the page's comment shows the real output


def test_the_epoch_metrics_snippet_prints_what_the_page_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    heading = "# Epoch metrics: torchmetrics objects and `engine.log(..., reduce=...)`"
    exec(compile(snippet(EPOCH_METRICS, heading), str(EPOCH_METRICS), "exec"), {"__name__": "howto"})
    shown = re.search(
        re.escape(heading) + r".*?```text\n\$ python epoch_metrics.py\n(.*?)\n```", EPOCH_METRICS.read_text(), re.DOTALL
    )
    assert shown is not None
    assert capsys.readouterr().out.strip() == shown.group(1)


def test_the_layout_section_names_only_files_and_folders_that_exist() -> None:
    found = re.search(r"## Layout\n\n```\n(.*?)```", CONTRIBUTING.read_text(), re.DOTALL)
    assert found is not None, "docs/contributing.md has no Layout block"
    named: list[Path] = []
    folder = ROOT
    for line in found.group(1).splitlines():
        if line[:18].strip():
            folder = ROOT / line[:18].strip()
            named.append(folder)
        for name in re.findall(r"(?<![\w/-])([\w/-]+\.(?:py|md))\b", line[18:]):
            named.append(ROOT / name if "/" in name else folder / name)  # docs/x.md: from the root
    # A package's modules, in parentheses that may go on over the next line: ``checkpoint/ (engine_state, ...)``.
    block = " ".join(line[18:] for line in found.group(1).splitlines())
    for package, modules in re.findall(r"\b([a-z_]+)/ \(([a-z_, .]+?)\)", block):
        named += [ROOT / "src" / "cadence" / package / f"{module}.py" for module in re.findall(r"[a-z_]+", modules)]
    assert len(named) > 30
    missing = [str(path.relative_to(ROOT)) for path in named if not path.exists()]
    assert not missing, f"docs/contributing.md's Layout names what does not exist: {missing}"
