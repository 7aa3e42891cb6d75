"""Convert pretrained transformers (and sketchlab's toy model) to sketched attention, and linearise them.

``_hf`` holds the transformers glue (attention and mask interfaces).
"""
