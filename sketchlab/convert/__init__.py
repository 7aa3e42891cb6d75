"""Convert pretrained transformers (and sketchlab's toy model) to sketched attention, and linearise them.

``families`` finds each family's attention modules; ``sketched`` holds the added module
(:class:`SketchedAttention`) and transformers' attention and mask functions; ``cache`` the
decoding state; ``convert`` the public entry points; ``linearize`` the staged training;
``pretrained`` the local loaders; ``_hf`` the transformers glue.
"""

from .convert import convert_attention, converted_modules, load_linearized, save_linearized
from .families import FAMILIES, attention_sites, family_of
from .linearize import LinearizeReport, linearize, perplexity
from .sketched import ATTENTION_NAME, SketchedAttention

__all__ = [
    "ATTENTION_NAME",
    "FAMILIES",
    "LinearizeReport",
    "SketchedAttention",
    "attention_sites",
    "convert_attention",
    "converted_modules",
    "family_of",
    "linearize",
    "load_linearized",
    "perplexity",
    "save_linearized",
]
