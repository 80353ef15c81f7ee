"""Prepare sources: one module per corpus format, each turning its input into ManifestItems."""
