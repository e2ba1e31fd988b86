"""Resuming never runs code from a checkpoint: every pickle a resume reads goes through a restricted loader
(memfit/safe_files.py, deepspeed_engine.weights_only_loads). Each hostile file here would create a marker file
if it were unpickled without restriction; each test checks that it is refused in one line and the marker is absent."""

from __future__ import annotations

import hashlib
import json
import pathlib
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from memfit.errors import UserError
from memfit.safe_files import load_dcp, read_torch


class Hostile:
    """Unpickled without restriction, creates ``marker`` (what an attacker's os.system would do)."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def _dcp_save(state: dict, where: pathlib.Path) -> None:
    with warnings.catch_warnings():  # one process, no process group: DCP says so
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=where)


def _dcp_load(state: dict, where: pathlib.Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_dcp(state, where)


def test_a_torch_file_holding_code_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "step_0000002" / "optimizer.pt"
    path.parent.mkdir()
    torch.save({"optimizer": Hostile(marker)}, path)
    with pytest.raises(UserError) as e:
        read_torch(path)
    assert not marker.exists()
    line = str(e.value)
    assert "\n" not in line and line.startswith("checkpoint step_0000002: optimizer.pt cannot be read safely (")
    assert "(Unsupported global: GLOBAL " in line, line  # the object it asked for, without torch's advice to allow it
    torch.save({"optimizer": {"state": {0: torch.ones(2)}, "lr": 0.1}}, path)
    assert read_torch(path)["optimizer"]["lr"] == 0.1  # tensors and plain values load


def test_a_damaged_torch_file_is_one_line_too(tmp_path):
    path = tmp_path / "step_0000003" / "rng.pt"
    path.parent.mkdir()
    path.write_bytes(b"not a torch file")
    with pytest.raises(UserError, match=r"^checkpoint step_0000003: rng.pt cannot be read safely \("):
        read_torch(path)


def test_dcp_checkpoints_load_and_a_hostile_metadata_is_refused_before_dcp_unpickles_it(tmp_path):
    ckpt = tmp_path / "step_0000004"
    _dcp_save({"w": torch.ones(3), "lr": 0.1, "betas": (0.9, 0.95)}, ckpt)
    state = {"w": torch.zeros(3), "lr": 0.0, "betas": (0.0, 0.0)}
    _dcp_load(state, ckpt)
    assert state["lr"] == 0.1 and state["betas"] == (0.9, 0.95) and torch.equal(state["w"], torch.ones(3))

    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    with pytest.raises(
        UserError, match=r"^checkpoint step_0000004: .metadata cannot be read safely \(Unsupported global: pathlib"
    ):
        _dcp_load(state, ckpt)
    assert not marker.exists()


def test_a_hostile_value_inside_a_dcp_checkpoint_is_refused_before_dcp_unpickles_it(tmp_path):
    """DCP keeps non-tensor entries (an optimizer's hyperparameters) as torch.save bytes and loads them with
    weights_only=False: the planner reads each weights-only first."""
    marker = tmp_path / "ran"
    ckpt = tmp_path / "step_0000005"
    _dcp_save({"w": torch.ones(3), "lr": Hostile(marker)}, ckpt)
    assert not marker.exists()
    with pytest.raises(UserError, match=r"^checkpoint step_0000005: entry lr cannot be read safely \("):
        _dcp_load({"w": torch.zeros(3), "lr": 0.0}, ckpt)
    assert not marker.exists()
    # and before any collective load, each rank's scan reads it from its .distcp file the same way
    from memfit.safe_files import vet_checkpoint

    with pytest.raises(UserError, match=r"^checkpoint step_0000005: __0_0.distcp/entry lr cannot be read safely \("):
        vet_checkpoint(ckpt)
    assert not marker.exists()


def test_deepspeeds_checkpoint_engine_loads_weights_only_while_memfit_resumes(tmp_path):
    """DeepSpeed's own engine unpickles with weights_only=False; inside ``weights_only_loads`` the same engine loads
    its ZeRO objects (the stage, the loss scaler) and refuses anything else; outside, it is as DeepSpeed made it."""
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from memfit.distributed.deepspeed_engine import weights_only_loads

    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    ours = tmp_path / "deepspeed" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ours.parent.mkdir()
    torch.save({"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0), "p": torch.ones(2)}, ours)
    marker = tmp_path / "ran"
    hostile = tmp_path / "deepspeed" / "mp_rank_00_model_states.pt"
    torch.save({"module": Hostile(marker)}, hostile)
    unsafe = engine.checkpoint_engine.load
    with weights_only_loads(engine):
        got = engine.checkpoint_engine.load(str(ours), map_location=torch.device("cpu"))
        assert got["zero_stage"] == ZeroStageEnum.gradients and isinstance(got["loss_scaler"], LossScaler)
        with pytest.raises(UserError, match=r"^checkpoint deepspeed: mp_rank_00_model_states.pt cannot be read safely"):
            engine.checkpoint_engine.load(str(hostile))
    assert not marker.exists()
    assert engine.checkpoint_engine.load == unsafe and "load" not in vars(engine.checkpoint_engine)  # DeepSpeed's own


def test_a_resume_from_a_checkpoint_whose_optimizer_file_holds_code_stops_in_one_line(tiny_cfg, tmp_path):
    """The whole path: a run's newest checkpoint, its optimizer.pt swapped for a hostile one and its manifest made
    to match (what a copied-in directory can hold): the resume stops with exit status 2's one line, nothing ran."""
    from memfit.train.loop import Trainer

    Trainer(tiny_cfg("train.max_steps=2", "train.checkpoint_every=2")).fit()
    step = tmp_path / "run" / "checkpoints" / "step_0000002"
    marker = tmp_path / "ran"
    torch.save({"optimizer": Hostile(marker), "scheduler": {}}, step / "optimizer.pt")
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / "optimizer.pt").read_bytes()
    manifest["files"]["optimizer.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"^checkpoint step_0000002: optimizer.pt cannot be read safely \("):
        Trainer(tiny_cfg("train.max_steps=3", "train.resume=true")).fit()
    assert not marker.exists()


def test_vetting_a_checkpoint_scans_every_pickle_under_it_and_loads_none(tmp_path):
    """What each rank runs before a collective load: DeepSpeed's own objects pass where allowed, a DCP checkpoint
    passes, and a hostile file anywhere under the checkpoint is named by its path inside it."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from memfit.safe_files import DS_CHECKPOINT_GLOBALS, vet_checkpoint

    ckpt = tmp_path / "step_0000006"
    _dcp_save({"w": torch.ones(3), "lr": 0.1}, ckpt)
    (ckpt / "deepspeed").mkdir()
    torch.save({"loss_scaler": LossScaler(1.0)}, ckpt / "deepspeed" / "optim_states.pt")
    torch.save({"scheduler": {"last_epoch": 3}}, ckpt / "scheduler.pt")
    vet_checkpoint(ckpt, DS_CHECKPOINT_GLOBALS)
    with pytest.raises(UserError, match=r"deepspeed/optim_states.pt cannot be read safely \(Unsupported global: deep"):
        vet_checkpoint(ckpt)  # without DeepSpeed's objects allowed
    marker = tmp_path / "ran"
    torch.save({"x": Hostile(marker)}, ckpt / "deepspeed" / "model_states.pt")
    refused = r"^checkpoint step_0000006: deepspeed/model_states.pt cannot be read safely \(Unsupported global: built"
    with pytest.raises(UserError, match=refused):
        vet_checkpoint(ckpt, DS_CHECKPOINT_GLOBALS)
    (ckpt / "deepspeed" / "model_states.pt").write_bytes(b"cut short")
    with pytest.raises(UserError, match=r"model_states.pt cannot be read safely \(Expected input to be a checkpoint"):
        vet_checkpoint(ckpt, DS_CHECKPOINT_GLOBALS)
    assert not marker.exists()
