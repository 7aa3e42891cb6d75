r"""Saving and reloading a converted model: :func:`save_linearized`, :func:`load_linearized`.

A save is a directory: the weights (``model.safetensors``, or transformers' shards), the
conversion options (:data:`OPTIONS_FILE`) and, for transformers models, ``save_pretrained``'s
``config.json``, which carries a second copy of the options (``config.sketchlab``); the toy model's
``model.safetensors`` carries it in its metadata (``sketchlab``). Loading cross-checks the copies
key by key and the weights against the model converted with them, so a save that was edited or
mixed from two runs is refused naming the file, the key and both values — never loaded as another
model (DESIGN §3).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from .convert import _options, convert_attention, converted_modules
from .families import family_of
from .old_keys import upgrade_keys
from .sketched import SketchedAttention

__all__ = ["OPTIONS_FILE", "load_linearized", "save_linearized"]

#: The conversion options of a save (one JSON object).
OPTIONS_FILE = "sketchlab_conversion.json"
#: The options every save records (those of :data:`LATER_DEFAULTS` and ``family`` may be absent: saves from before
#: they existed).
RECORDED = ("attention", "p", "m", "rank", "window", "sinks", "local", "normalize", "non_negative", "eps", "gate",
            "gate_init", "tied", "input_norm", "seed", "family", "cache", "decay", "state", "beta", "exact_layers",
            "qk_conv")
#: The options of a save written before they existed, as it was converted: untied, no input norm, no long-context
#: memory (DESIGN §7), no exact layers.
LATER_DEFAULTS = {"tied": False, "input_norm": False, "cache": 0, "decay": None, "state": "additive", "beta": "head",
                  "exact_layers": [], "qk_conv": 0}
#: Metadata key of the toy model's ``model.safetensors`` holding the options' second copy.
META_KEY = "sketchlab"


def _sources(model: nn.Module) -> list[str]:
    """Where ``model`` was read from, as far as it records it: ``config._name_or_path`` (the
    directory ``from_pretrained`` read) and :func:`~sketchlab.hf.pretrained.load_pretrained`'s
    record (the GGUF file or model directory), those that exist on this machine."""
    found = []
    for where in (getattr(model, "sketchlab_source", None),
                  getattr(getattr(model, "config", None), "_name_or_path", None)):
        if isinstance(where, (str, Path)) and str(where) and os.path.exists(where):
            found.append(str(where))
    return found


def save_linearized(model: nn.Module, directory, *, inputs=()) -> Path:
    """Write a converted model to ``directory``: ``model.safetensors`` (every weight, the maps
    included) and :data:`OPTIONS_FILE` (the conversion options); transformers models also get
    ``save_pretrained``'s ``config.json``. Reload with :func:`load_linearized`.

    Refused before anything is written (``ValueError``): a ``directory`` that is, or holds, an input
    of the run — the directory or GGUF file the teacher was loaded from (``config._name_or_path``,
    :func:`sketchlab.hf.pretrained.load_pretrained`'s record) or any path of ``inputs`` (the
    text, a Θ export, …), by any spelling, symlink or hard link (:func:`sketchlab.io.atomic.check_output_directory`).
    The files are built beside ``directory`` and moved in together at the end
    (:func:`sketchlab.io.staged_directory`): a save that fails leaves ``directory`` as it was.
    Missing parents are created. Every file gets the permissions a new file gets (``0o666 & ~umask``).
    """
    from safetensors.torch import save_file

    from ..io.atomic import check_output_directory, staged_directory

    converted_modules(model)
    options = dict(_options(model))
    check_output_directory(directory, [*_sources(model), *inputs], label="save_linearized")
    directory = Path(directory)
    Path(os.path.realpath(directory)).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(options, indent=1, sort_keys=True) + "\n"
    with staged_directory(directory, last=(OPTIONS_FILE,)) as stage:
        (stage / OPTIONS_FILE).write_text(text, encoding="utf-8")
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(stage)
        else:
            state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            save_file(state, str(stage / "model.safetensors"), metadata={META_KEY: json.dumps(options, sort_keys=True)})
        mode = (stage / OPTIONS_FILE).stat().st_mode & 0o777  # what Python's open gave: 0o666 & ~umask
        for f in stage.iterdir():  # safetensors creates its files 0o600
            if f.is_file():
                os.chmod(f, mode)
    return directory


def _read_json(path: Path) -> dict:
    """The JSON object in ``path``; a ``ValueError`` naming the file when it is not one."""
    from ..io.formats import _loads_json

    try:  # the project's JSON reader: nesting bounded, a too-deep file a ValueError naming it
        data = _loads_json(path.read_text(encoding="utf-8"), str(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); was it written by sketchlab.save_linearized?") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror or err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _weight_files(directory: Path) -> list[Path]:
    """The weight files of a save: transformers' index lists its shards; else every ``*.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = _read_json(index).get("weight_map")
        if not isinstance(shards, dict):
            raise ValueError(f"{index}: no 'weight_map' object; the save is damaged: save the model again")
        return [directory / name for name in sorted(set(map(str, shards.values())))]
    return sorted(directory.glob("*.safetensors"))


def _copies(directory: Path, weights: dict) -> dict:
    """Every recorded copy of the options: ``{file: options}``."""
    copies = {}
    options_path = directory / OPTIONS_FILE
    if options_path.is_file():
        copies[options_path] = _read_json(options_path)
    config_path = directory / "config.json"
    if config_path.is_file():
        cfg = _read_json(config_path)
        if "sketchlab" in cfg:
            copies[config_path] = cfg["sketchlab"]
    for path, meta in weights.items():
        if META_KEY in meta:
            from ..io.formats import _loads_json

            try:
                copies[path] = _loads_json(meta[META_KEY], f"{path}: metadata {META_KEY!r}")
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: metadata {META_KEY!r} is not valid JSON ({err})") from None
    for path, options in copies.items():
        if not isinstance(options, dict):
            where = f"{path}: 'sketchlab'" if path.name == "config.json" else str(path)
            raise ValueError(f"{where}: the conversion options must be a JSON object, got {type(options).__name__}")
    return copies


def _consistent(copies: dict, directory: Path) -> dict:
    """The one set of options all copies agree on, each key checked; else a ``ValueError`` naming the
    files, the key and both values."""
    if not copies:
        raise ValueError(f"{directory}: no conversion options ({OPTIONS_FILE}, or 'sketchlab' in config.json); "
                         "was it written by sketchlab.save_linearized?")
    # absent: saved before the option existed
    copies = {path: {**LATER_DEFAULTS, **options} for path, options in copies.items()}
    (first, options), *others = copies.items()
    for path, other in others:
        for key in sorted(set(options) | set(other)):
            mine, theirs = options.get(key, "(absent)"), other.get(key, "(absent)")
            if mine != theirs:
                raise ValueError(f"{directory}: the saved conversion options disagree: {first.name} has {key}={mine!r}, "
                                 f"{path.name} has {key}={theirs!r} (a copy was edited, or the files come from two "
                                 "saves); restore the file or save the converted model again (sketchlab.save_linearized)")
    unknown = sorted(set(options) - set(RECORDED))
    if unknown:
        raise ValueError(f"{first}: unknown conversion option {unknown[0]!r} (the options are {list(RECORDED)}); "
                         "the file was edited or comes from another program")
    missing = [key for key in RECORDED if key not in options and key != "family"]
    if missing:
        raise ValueError(f"{first}: the conversion option {missing[0]!r} is missing; the file was edited or is "
                         "damaged: save the converted model again")
    return dict(options)


def _read_weights(files: list[Path]) -> tuple[dict, dict]:
    """``({file: metadata}, {name: tensor})`` of the weight files; an unreadable one a ``ValueError`` naming it."""
    from ..io.formats import _read_safetensors

    metas, state = {}, {}
    for f in files:
        try:
            entries, meta = _read_safetensors(f)
        except FileNotFoundError as err:
            raise ValueError(f"{f}: listed by the save but missing ({err}); save the converted model again") from None
        metas[f] = meta
        state.update(entries)
    return metas, state


def load_linearized(directory, model: nn.Module) -> nn.Module:
    """Convert ``model`` (the teacher architecture, freshly loaded or built) as recorded in
    ``directory`` and load every saved weight into it (strict: nothing missing, nothing left over,
    except weights tied to others). Returns ``model``.

    ``directory`` is a :func:`save_linearized` (or ``save_pretrained`` of a converted model) output.
    Maps made by a custom ``feature_map`` cannot be rebuilt from their name: convert ``model`` with
    the same ``feature_map`` first, then call this (the options must then agree). Saves of earlier versions load
    with the outputs they gave: their keys are renamed first (:func:`~sketchlab.convert.old_keys.upgrade_keys`,
    given each converted layer's index in the model: a fitted map saved by acaf206 holds the heads of every layer).

    Raises
    ------
    ValueError
        Before ``model`` is converted: an options file that is not valid JSON (naming the file), copies
        of the options that disagree (:data:`OPTIONS_FILE`, ``config.json``'s ``sketchlab``, the toy
        weights' metadata; naming the files, the key and both values), an unknown or missing option, a
        value the conversion refuses (naming the file and the key), a save of another model family than
        ``model``'s (naming both), no ``.safetensors`` weights or an empty, truncated or corrupt one
        (naming it), a model already converted with other options (naming each that differs, with both
        values), saved weights whose names or shapes do not match the model converted with the saved
        options (naming the tensor and both shapes), a save of an earlier version that cannot load with the
        outputs it gave (naming the file and the key: :func:`~sketchlab.convert.old_keys.upgrade_keys`).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (a sketchlab.save_linearized output is one)")
    files = _weight_files(directory)
    if not files:
        raise ValueError(f"{directory}: no .safetensors weights")
    metas, state = _read_weights(files)
    copies = _copies(directory, metas)
    options = _consistent(copies, directory)
    where = next(iter(copies))
    saved_family, family = options.pop("family", None), family_of(model)
    if saved_family is not None and saved_family != family:
        raise ValueError(f"{directory}: saved from a model of the {saved_family!r} family, and "
                         f"{type(model).__name__} is of the {family!r} family; load it onto the architecture it was "
                         "converted from")
    if converted_modules(model, required=False):
        own = {k: v for k, v in _options(model).items() if k not in ("family", "gate_init")}
        saved = {k: v for k, v in options.items() if k != "gate_init"}  # an initial value: the weights hold the gates
        differ = {k: (own.get(k), saved.get(k)) for k in sorted(set(own) | set(saved)) if own.get(k) != saved.get(k)}
        if differ:
            named = ", ".join(f"{k}={mine!r} (saved {theirs!r})" for k, (mine, theirs) in differ.items())
            raise ValueError(f"{directory}: the model is already converted with other options than the saved ones: "
                             f"{named}")
    else:
        if options["attention"] == "custom":
            raise ValueError(f"{directory}: the maps came from a custom feature_map; convert the model with it first")
        gate_init = options["gate_init"]
        build = dict(options, gate_init=0.0 if gate_init in ("mass", "search") else gate_init)
        _convert_checked(model, build, where)
        _options(model)["gate_init"] = gate_init  # recorded as the saved run used it
    own = model.state_dict()
    prefix = _match_prefix(set(state), set(own))
    state = {prefix + k: v for k, v in state.items()}
    exact = set(options["exact_layers"])
    converted = [(name, module) for name, module in model.named_modules() if isinstance(module, SketchedAttention)]
    layers = [i for i in range(len(converted) + len(exact)) if i not in exact]  # each one's index in the model
    for (name, module), layer in zip(converted, layers):  # the maps' names before the one layer core
        try:
            upgrade_keys(state, name + ".", module, layer)
        except ValueError as err:  # a save of an earlier version that cannot load as it ran: the file, the key
            raise ValueError(f"{files[0] if len(files) == 1 else directory}: {err}") from None
    unexpected = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state) - _tied(model))
    if unexpected or missing:
        raise ValueError(f"{directory}: weights do not match the converted model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"{directory}: tensor {name!r} has shape {list(tensor.shape)} in the saved weights and "
                             f"{list(own[name].shape)} in the model converted with the saved options of {where.name} "
                             f"(attention={options['attention']!r}, p={options['p']}, m={options['m']}, "
                             f"rank={options['rank']}, tied={options['tied']}, input_norm={options['input_norm']}): the options or the weights were edited "
                             "or come from two saves; save the converted model again")
    model.load_state_dict(state, strict=False)
    return model


def _convert_checked(model: nn.Module, options: dict, where: Path) -> None:
    """``convert_attention(model, **options)``; a value it refuses names the file it was read from."""
    try:
        convert_attention(model, **options)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: the saved conversion options are refused: {err}") from None


def _match_prefix(saved: set, own: set) -> str:
    """``""``, or the prefix (``"model."``) that saved names lack (a base model saved, a head model loading)."""
    if saved & own:
        return ""
    for name in own:
        for s in saved:
            if name.endswith("." + s):
                return name[: -len(s)]
    return ""


def _tied(model: nn.Module) -> set:
    """Names of parameters that alias another one (tied embeddings): save_pretrained writes one copy."""
    seen, tied = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = (tensor.data_ptr(), tuple(tensor.shape)) if tensor.numel() else None
        if key is not None and key in seen:
            tied.add(name)
            tied.add(seen[key])
        elif key is not None:
            seen[key] = name
    return tied
