"""Equal-compute quality benchmark (``benchmark``) and the study over its outputs (``study``)."""
