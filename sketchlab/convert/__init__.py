"""Convert pretrained transformers (and sketchlab's toy model) to sketched attention, and linearise them.

``families`` finds each family's attention modules; ``sketched`` holds the added module
(:class:`SketchedAttention`) and transformers' attention and mask functions; ``cache`` the
decoding state; ``convert`` the public entry points; ``saved`` saving and reloading a converted model; ``linearize``
the staged training (one entry point, routed by family), its stages ``teacher``, ``theta``, ``transfer`` (with
the one attention-transfer loss; ``spread`` over processes) and ``lora``, ``evaluate`` the reported measures,
``stages`` the checks around the stages; ``mqar`` the toy MQAR checkpoint's family (a path given to ``linearize``);
``scale`` the tied LLoPS map and the gate calibration; ``exact`` the layers kept exact and ``ranking`` which to
keep. The family table, the local loaders and the transformers glue it shares with capture are
:mod:`sketchlab.hf`'s.
"""

from .convert import convert_attention, converted_modules
from .exact import ExactAttention, KVState
from .families import FAMILIES, attention_sites, family_of
from .linearize import LinearizeReport, linearize, lora_finetune, perplexity, token_nll
from .ranking import rank_exact_layers
from .saved import load_linearized, save_linearized
from .scale import TiedLLoPSMap, calibrate_gates
from .sketched import ATTENTION_NAME, SketchedAttention

__all__ = [
    "ATTENTION_NAME",
    "ExactAttention",
    "KVState",
    "FAMILIES",
    "LinearizeReport",
    "SketchedAttention",
    "TiedLLoPSMap",
    "attention_sites",
    "calibrate_gates",
    "convert_attention",
    "converted_modules",
    "family_of",
    "linearize",
    "load_linearized",
    "lora_finetune",
    "perplexity",
    "rank_exact_layers",
    "save_linearized",
    "token_nll",
]
