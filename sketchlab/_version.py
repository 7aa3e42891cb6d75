"""The version of sketchlab (read by setup.cfg and recorded in every Θ export)."""

__version__ = "0.1.0"
