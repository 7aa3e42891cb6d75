"""The one family table (``sketchlab.hf.families``) and what capture, conversion and evaluation read from it."""

from types import SimpleNamespace

from sketchlab.hf.families import FAMILY_TABLE, Family, config_int, family_of_type, supported_types


def test_family_of_type_reads_the_table():
    for name, family in FAMILY_TABLE.items():
        for model_type in family.model_types:
            assert family_of_type(model_type) == name
    assert family_of_type("t5") is None and family_of_type(None) is None


def test_supported_types_without_encoders_leaves_out_the_encoder_families():
    every = supported_types().split(", ")
    causal = supported_types(encoders=False).split(", ")
    encoders = {t for f in FAMILY_TABLE.values() if f.encoder for t in f.model_types}
    assert encoders == {"bert", "roberta"}
    assert set(every) == {t for f in FAMILY_TABLE.values() for t in f.model_types}
    assert set(causal) == set(every) - encoders


def test_config_int_takes_the_first_integer_attribute():
    cfg = SimpleNamespace(num_attention_heads=None, n_head=True, num_heads=4, num_key_value_heads=2)
    assert config_int(cfg, Family.heads) == 4  # None and a bool are not head counts
    assert config_int(cfg, Family.kv_heads) == 2
    assert config_int(SimpleNamespace(), Family.heads) is None and config_int(None, Family.heads) is None
