"""What capture and conversion share about transformers models, below both (DESIGN §2).

``families`` the one table of model families (:data:`~sketchlab.hf.families.FAMILY_TABLE`);
``interface`` transformers' attention and mask interfaces and the implementation switch;
``pretrained`` the local loaders (a ``save_pretrained`` directory or a GGUF file). transformers is
imported only inside the functions that need it (the optional extra).
"""
