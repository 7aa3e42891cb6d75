"""Below capture and conversion, what both know of transformers models: ``families`` (the one family table),
``interface`` (transformers' attention and mask interfaces), ``pretrained`` (the local loaders)."""
