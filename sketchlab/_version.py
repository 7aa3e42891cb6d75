"""The version of sketchlab (read by pyproject.toml and recorded in every Θ export)."""

__version__ = "0.1.0"
