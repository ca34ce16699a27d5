"""Hugging Face loading of an export: ``AutoModelForCausalLM`` / ``AutoTokenizer`` with
``trust_remote_code=True``, lm-evaluation-harness on top (docs/hf.md).

The modules here are not imported by the trainer. :mod:`spider_titan.hf.bundle` copies them, and the
model code they import, into an export folder with the imports made relative, so the folder loads
with transformers alone and runs this package's own code (nothing is written twice).
"""
