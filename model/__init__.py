"""The network, tokenizer, decoding, training and evaluation. Importing the package turns MKL's
buffer pool off before torch loads (``model.engine.allocator.disable_mkl_buffer_pool``)."""

from model.engine.allocator import disable_mkl_buffer_pool

disable_mkl_buffer_pool()
