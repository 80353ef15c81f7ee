"""Data preparation: audio loading, codec encoding, manifests and the prepared on-disk format."""
