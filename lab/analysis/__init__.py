"""Analyses of a trained model: the segment capacity a corpus needs (``segment_capacity``)."""
