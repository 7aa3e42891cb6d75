r"""Checkpoints: the resumable training state of :func:`~sketchlab.tasks.train_mqar`, and model directories.

Safetensors + JSON, never pickle. A training state (``DIR`` is ``train_mqar``'s ``out``)::

    DIR/checkpoints/step-00000100/model.safetensors     # the model's state_dict
    DIR/checkpoints/step-00000100/trainer.safetensors   # AdamW moments and steps, RNG states
    DIR/checkpoints/step-00000100/state.json            # run identity, step, losses, evaluations

is built beside its final name and renamed into place whole (:func:`sketchlab.io.atomic.staged_directory`,
each file by :func:`~sketchlab.io.atomic.atomic_write`), so an interruption leaves the previous
checkpoints or the new one, never half of one. A model directory (:func:`save_checkpoint`) holds
``model.safetensors`` and ``config.json``. Readers check names, shapes, finite values and the run
identity before restoring anything; errors name the file and the tensor or key.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from torch import nn

from ..io.atomic import atomic_write, staged_directory
from .attention import ToyKernel
from .legacy import upgrade_keys
from .model import TransformerConfig, TransformerLM

__all__ = ["STATE_FORMAT", "latest_checkpoint", "load_checkpoint", "read_training_state", "save_checkpoint",
           "write_training_state"]

#: The ``format`` of a training state's ``state.json``.
STATE_FORMAT = "sketchlab.tasks.train/1"


def latest_checkpoint(out) -> Path | None:
    """The newest complete ``step-N`` checkpoint directory under ``out/checkpoints`` (``None`` if none)."""
    root = Path(out) / "checkpoints"
    if not root.is_dir():
        return None
    found = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit())
    return found[-1] if found else None


def _save_tensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    with atomic_write(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))


def _save_json(payload: dict, path: Path, indent: int) -> None:
    with atomic_write(path) as tmp:
        Path(tmp).write_text(json.dumps(payload, indent=indent, sort_keys=True) + "\n")


def write_training_state(out, step: int, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator,
                         state: dict, keep: int) -> Path:
    """Write ``out/checkpoints/step-N`` (N = ``step``) whole, keep the newest ``keep``; returns its path.
    ``state.json`` holds ``state`` (the run identity, losses, evaluations), the step and the optimiser's
    parameter groups. Staging directories a killed writer left are removed first (nothing reads them)."""
    root = Path(out) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".*step-*"):  # staging directories of a killed writer
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:08d}"
    with staged_directory(final) as stage:
        _fill_checkpoint(Path(stage), model, opt, gen, state, step)
    for old in sorted(p for p in root.iterdir() if p.name.startswith("step-"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fill_checkpoint(directory: Path, model, opt, gen: torch.Generator, state: dict, step: int) -> None:
    """The three files of a training state, written into ``directory`` (the staging directory)."""
    _save_tensors(model.state_dict(), directory / "model.safetensors")
    sd = opt.state_dict()
    tensors = {f"optim.{idx}.{key}": val for idx, st in sd["state"].items() for key, val in st.items()}
    tensors["rng.data"] = gen.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    _save_tensors(tensors, directory / "trainer.safetensors")
    _save_json({**state, "format": STATE_FORMAT, "step": step, "param_groups": sd["param_groups"]},
               directory / "state.json", indent=1)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, each checked finite; ``ValueError`` names the file and tensor."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing")
    try:
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for truncated or foreign files
        raise ValueError(f"checkpoint file {path}: unreadable safetensors file ({err})") from err
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"checkpoint file {path}: tensor {name} holds {bad} non-finite value(s) (NaN/inf: a "
                             "diverged run or a damaged file); use an earlier checkpoint or start anew")
    return tensors


def _load_weights(model: nn.Module, weights: dict, path: Path) -> None:
    """``model.load_state_dict(weights)`` after checking the names and shapes; ``ValueError`` names the file.
    The keys of older toy kernels are renamed first (:func:`~sketchlab.tasks.legacy.upgrade_keys`)."""
    weights = dict(weights)
    for name, module in model.named_modules():
        if isinstance(module, ToyKernel):
            upgrade_keys(module, weights, f"{name}.")
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or unexpected:
        raise ValueError(f"checkpoint file {path} does not hold this model's weights: missing {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                         f"{' ...' if len(unexpected) > 4 else ''}")
    for name, t in own.items():
        if tuple(weights[name].shape) != tuple(t.shape):
            raise ValueError(f"checkpoint file {path}: tensor {name} has shape {tuple(weights[name].shape)}, the model "
                             f"expects {tuple(t.shape)}")
    model.load_state_dict(weights, strict=True)


def _completed(identity):
    """A checkpoint's run identity with its model config completed as this version completes it: an
    attention option added since (e.g. ``affine``, default ``false``) then takes its default, so a run of
    the same settings still resumes. A config this version cannot build is left as it is (the comparison
    then names it)."""
    if not isinstance(identity, dict) or not isinstance(identity.get("model"), dict):
        return identity
    try:
        model = json.loads(json.dumps(TransformerConfig(**identity["model"]).to_dict()))
    except (TypeError, ValueError):
        return identity
    return {**identity, "model": model}


def read_training_state(path: Path, identity: dict, model: nn.Module, opt: torch.optim.Optimizer,
                        gen: torch.Generator) -> dict:
    """Restore model, optimiser and generators from a ``step-N`` directory; returns its ``state.json``.

    ``identity`` is this run's (JSON types): another one's checkpoint is refused, naming the differing
    fields. A truncated, foreign or non-finite file raises ``ValueError`` naming the file (and the tensor
    or key) before anything is restored.
    """
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint {path}: unreadable state.json ({err})") from err
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"checkpoint {path}: state.json is not a {STATE_FORMAT} training state")
    theirs = _completed(state.get("identity", {}))
    if theirs != identity:
        keys = sorted(set(theirs) | set(identity))
        diffs = [f"{key}: {json.dumps(theirs.get(key), sort_keys=True)} in the checkpoint, "
                 f"{json.dumps(identity.get(key), sort_keys=True)} in this run"
                 for key in keys if theirs.get(key) != identity.get(key)]
        raise ValueError(
            f"checkpoint {path} was written by another run configuration, so this run cannot resume from it "
            f"({'; '.join(diffs)}); use another output directory or the checkpoint's settings"
        )
    for key, kind in (("step", int), ("history", list), ("losses", list), ("evals", list), ("param_groups", list)):
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise ValueError(f"checkpoint {path / 'state.json'}: {key!r} must be a JSON {kind.__name__}, "
                             f"got {state.get(key)!r:.60}")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in state["losses"]):
        raise ValueError(f"checkpoint {path / 'state.json'}: the recorded losses hold a non-finite value")
    weights = _read_tensors(path / "model.safetensors")
    tensors = _read_tensors(path / "trainer.safetensors")
    for name in ("rng.data", "rng.torch"):
        if name not in tensors or tensors[name].dtype != torch.uint8:
            raise ValueError(f"checkpoint file {path / 'trainer.safetensors'}: tensor {name} (a generator state, "
                             "uint8) is missing; not a sketchlab training state")
    per_param: dict[int, dict] = {}
    for name, val in tensors.items():
        if name.startswith("optim."):
            try:
                _, idx, key = name.split(".", 2)
                per_param.setdefault(int(idx), {})[key] = val
            except ValueError:
                raise ValueError(f"checkpoint file {path / 'trainer.safetensors'}: unexpected tensor {name}") from None
    params = [p for group in opt.param_groups for p in group["params"]]
    for idx, entry in per_param.items():
        if not 0 <= idx < len(params) or any(v.ndim and v.shape != params[idx].shape for v in entry.values()):
            raise ValueError(f"checkpoint file {path / 'trainer.safetensors'}: optimiser state {idx} does not match "
                             "this model's parameters")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _load_weights(model, weights, path / "model.safetensors")
    try:
        opt.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})
        gen.set_state(tensors["rng.data"])
        torch.set_rng_state(tensors["rng.torch"])
    except (ValueError, RuntimeError, KeyError, TypeError) as err:
        model.load_state_dict(before)
        raise ValueError(f"checkpoint {path}: the optimiser or generator state does not fit this run ({err})") from err
    return state


def save_checkpoint(directory, model: TransformerLM, *, extra: dict | None = None) -> Path:
    """Write ``model.safetensors`` (weights) and ``config.json`` (config + ``extra``) into ``directory``.

    Both files are written atomically; ``extra`` must be JSON-serialisable (e.g. the task and
    the training result).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"format": "sketchlab.tasks.TransformerLM/1", "config": model.config.to_dict(), "extra": extra or {}}
    _save_tensors(model.state_dict(), directory / "model.safetensors")
    _save_json(payload, directory / "config.json", indent=2)
    return directory


def load_checkpoint(directory) -> tuple[TransformerLM, dict]:
    """Load a :func:`save_checkpoint` directory; returns ``(model in eval mode, extra)``.

    Raises ``FileNotFoundError`` when a file is missing and ``ValueError`` naming the file (and the
    tensor) for a config that is not a TransformerLM's, a truncated or foreign weights file, weights
    of another shape, or non-finite weights.
    """
    directory = Path(directory)
    cfg_path, w_path = directory / "config.json", directory / "model.safetensors"
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint {directory}: missing {p.name}")
    try:
        payload = json.loads(cfg_path.read_text())
        config = TransformerConfig(**payload["config"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"checkpoint {cfg_path}: not a sketchlab TransformerLM config ({err})") from err
    if not isinstance(payload, dict) or not isinstance(payload.get("extra", {}), dict):
        raise ValueError(f"checkpoint {cfg_path}: not a sketchlab TransformerLM config (extra must be a JSON object)")
    model = TransformerLM(config)
    _load_weights(model, _read_tensors(w_path), w_path)  # names, shapes, finite values checked
    model.eval()
    return model, payload.get("extra", {})
