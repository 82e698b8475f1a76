"""``ModelParallelStrategy`` on 4 CPU ranks as 2x2 (FSDP x tensor parallel), through the example's own ``train``:
losses equal one process's for 5 steps (with clipping's norm over both mesh dimensions), and its checkpoint resumes
on 4 ranks as 4x1, on 2 DDP ranks and on one process with the same next loss. One start of 4 ranks and one of 2
(starting ranks costs far more than the jobs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cadence.strategies.fsdp_checkpoint import load_model_shards
from cadence.testing.spawn import spawn
from tests.distributed import model_parallel_workers as workers
from tests.distributed.workers import results_by_job

pytestmark = pytest.mark.slow
TOLERANCE = {"rel": 1e-5, "abs": 1e-6}
GLOBAL_BATCH = 8  # every layout reads the same global batches, so every layout computes the same losses


def test_two_by_two_equals_one_process_and_its_checkpoint_resumes_on_4x1_ddp_and_one_process(tmp_path: Path) -> None:
    """Also: the run-level callbacks work on the 2x2 mesh (one more job of the same start of 4 ranks)."""
    saved = str(tmp_path / "2x2" / "checkpoints" / "checkpoint_0")
    four = results_by_job(
        spawn(
            4,
            workers.on_one_group,
            [
                ("collectives", workers.collectives, (2,)),
                ("2x2", workers.train, (5, str(tmp_path / "2x2"), 2, GLOBAL_BATCH)),
                ("4x1", workers.train, (6, str(tmp_path / "4x1"), 1, GLOBAL_BATCH, "2d", saved)),
                ("callbacks", workers.callbacks_on_a_mesh, (str(tmp_path / "callbacks"),)),
            ],
            timeout=600.0,
        )
    )
    ddp = spawn(2, workers.train, 6, str(tmp_path / "ddp"), 1, GLOBAL_BATCH, "ddp", saved, timeout=600.0)
    # The reference: one process, the plain model (no plan), uninterrupted but for a save and resume of its own.
    reference = workers.train(5, str(tmp_path / "one"), 1, GLOBAL_BATCH, "single")
    own = str(tmp_path / "one" / "checkpoints" / "checkpoint_0")
    reference += workers.train(6, str(tmp_path / "one_on"), 1, GLOBAL_BATCH, "single", own)
    one = workers.train(6, str(tmp_path / "one_from_2x2"), 1, GLOBAL_BATCH, "single", saved)

    # Ranks 0 and 1 form data-parallel replica 0 (its two tensor-parallel ranks), 2 and 3 replica 1.
    collectives = four["collectives"]
    assert [result["data_parallel"] for result in collectives] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert collectives[0]["mesh"] == [[0, 1], [2, 3]]
    for result in collectives:
        # A sum counts each replica once; mean, max and gather agree on every rank.
        assert (result["sum"], result["integer sum"], result["mean"]) == (2.0, 6, 0.5)
        assert (result["max"], result["gather"]) == (3.0, [0.0, 1.0])

    for losses in four["2x2"]:
        assert losses == pytest.approx(reference[:5], **TOLERANCE)
    for resumed in [*four["4x1"], *ddp, one]:
        assert resumed == pytest.approx(reference[5:], **TOLERANCE)
    # save_model gathered the full weights from both mesh dimensions: exactly what the 2x2 checkpoint's shards hold,
    # read back into the plain model in this process (the losses above compare the weights with one process's).
    model = workers.example().TinyTransformer()
    load_model_shards(model, Path(saved) / "model_0.shards")
    exported = load_file(tmp_path / "2x2" / "model" / "model.safetensors")
    assert sorted(exported) == sorted(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported[name], tensor), name

    # EMA (validation on its average), FiniteCheck, clipping, ThroughputMonitor and best-k Checkpoint (saving in the
    # background) ran; SIGUSR1 on rank 0 alone stopped every rank at the same step with a checkpoint and status 75.
    callbacks = four["callbacks"]
    assert all(result == callbacks[0] for result in callbacks)
    assert (callbacks[0]["code"], callbacks[0]["step"]) == (75, 3)
    # One checkpoint per step: step 2's periodic save waits for its validation and is the ranked one too (before
    # issue 27 item 1 it was saved twice, before and after that validation), then Preemption's at step 3.
    assert callbacks[0]["best"] in callbacks[0]["checkpoints"] and len(callbacks[0]["checkpoints"]) == 2
    metrics = callbacks[0]["metrics"]
    assert {"val/loss", "grad_norm", "throughput/samples_per_sec"} <= set(metrics)
    assert metrics["test/loss"] == pytest.approx(metrics["val/loss"], rel=1e-6)  # the background save loads back
