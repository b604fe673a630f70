"""pdops: deploy and operate SGLang prefill/decode disaggregated serving."""

__version__ = "0.1.0"
