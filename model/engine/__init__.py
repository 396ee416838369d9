"""The inference engine: CPU features and the kernel plan, the linear kernels and the fused C++
step kernels, the KV cache, the encoder and decoder step, beam search, the shortlist, decoding
sessions, the translator, and loading a checkpoint for inference."""
