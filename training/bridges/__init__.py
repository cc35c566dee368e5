"""Bridges, built: the same texts read by two backbones (`pairing.py`, cached), then a transformer
bridge trained on those pairs (`transformer.py`, `tmod-train bridge`) or an alignment fitted to them
(`align.py`, `tmod-train align`). What serves them is server/bridges/."""
