"""Scoring a model with judges that are not the model itself: error rates, TTS intelligibility,
speaker similarity and quality on held-out data (``judged``), the original recordings of
prepared items (``recordings``) and the listening page (``report``)."""
